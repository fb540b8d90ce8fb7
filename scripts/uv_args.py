"""What pip's configuration says, for uv, which reads neither pip.conf nor PIP_* variables (as
`pip config list` of PYTHON's pip reports them).

    python uv_args.py PYTHON args   the uv arguments, one per line: the indexes, the
                                    find-links folders and the constraint files
    python uv_args.py PYTHON cert   the CA bundle pip is told to trust, if any (uv's
                                    SSL_CERT_FILE)"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's scopes from the weakest to the strongest: a later one's value replaces an earlier one's.
SCOPES = ("global", "user", "site", ":env:")
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_settings(python: str) -> dict[str, str]:
    """Each key pip's configuration sets, with the value of its strongest scope."""
    listed = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings: dict[str, dict[str, str]] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        settings.setdefault(key, {})[scope] = value.strip("'\"")
    return {
        key: next(by_scope[s] for s in reversed(SCOPES) if s in by_scope)
        for key, by_scope in settings.items()
        if any(s in by_scope for s in SCOPES)
    }


def main(python: str, what: str) -> int:
    settings = pip_settings(python)
    if what == "cert":
        if "cert" in settings:
            print(settings["cert"])
        return 0
    for key, flag in FLAGS.items():
        for value in shlex.split(settings.get(key, "")):
            print(flag)
            print(value)
    if "no-index" in settings:
        print("--no-index")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
