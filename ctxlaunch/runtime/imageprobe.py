"""`python3 -m ctxlaunch.runtime.imageprobe`: can this environment (an image's) start the trainer?

Run inside the image by `ctxlaunch image check` (ctxlaunch.launch.image), or directly in any
environment. Prints one line per check, `ok NAME: detail` or `FAIL NAME: detail`, and exits 0
when every check passes, 1 otherwise:
- torch: it imports, at the project's pinned version;
- nccl: torch.distributed is built with NCCL (what multi-GPU pods need), and its version;
- entrypoint: the pods' command module (ctxlaunch.runtime.podentry) imports;
- train: `ctxlaunch train --help` runs (the console script the image puts on PATH).
--no-nccl skips the NCCL check (a CPU-only image for gloo).
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Callable

TORCH_VERSION = "2.13.0"
"""The torch the project pins (scripts/setup TORCH_VERSION; the Dockerfile's base image)."""


def check_torch() -> str:
    import torch

    version = torch.__version__.split("+")[0]
    if version != TORCH_VERSION:
        raise RuntimeError(f"torch {torch.__version__}, the project pins {TORCH_VERSION}")
    return f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"


def check_nccl() -> str:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        raise RuntimeError(
            f"torch {torch.__version__} is built without NCCL (CUDA "
            f"{torch.version.cuda or 'none'}): a GPU job cannot communicate; "
            "use a CUDA build of torch"
        )
    version = torch.cuda.nccl.version()
    return "NCCL " + ".".join(map(str, version if isinstance(version, tuple) else (version,)))


def check_entrypoint() -> str:
    importlib.import_module("ctxlaunch.runtime.podentry")
    return "python3 -m ctxlaunch.runtime.podentry imports"


def check_train() -> str:
    script = shutil.which("ctxlaunch")
    if script is None:
        raise RuntimeError("no ctxlaunch on PATH (is ctxlaunch installed in the image?)")
    result = subprocess.run(
        [script, "train", "--help"], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"`ctxlaunch train --help` exited {result.returncode}: "
            + (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        )
    return f"{script} train --help runs"


CHECKS: dict[str, Callable[[], str]] = {
    "torch": check_torch,
    "nccl": check_nccl,
    "entrypoint": check_entrypoint,
    "train": check_train,
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    unknown = [a for a in args if a != "--no-nccl"]
    if unknown:
        print(
            f"usage: python3 -m ctxlaunch.runtime.imageprobe [--no-nccl] (not {unknown})",
            file=sys.stderr,
        )
        return 2
    failed = 0
    for name, check in CHECKS.items():
        if name == "nccl" and "--no-nccl" in args:
            continue
        try:
            print(f"ok {name}: {check()}", flush=True)
        except Exception as exc:  # every failure is a finding to report, not a crash
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
