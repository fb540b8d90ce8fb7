"""`fabric.env` values given by reference (contract/spec/secret_refs.py), turned into what each
target runs: shell lines that read them where a batch script starts, the values themselves
for a job started here, never the value written into an artifact."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ctxlaunch.contract.bounded import BoundedReadError, read_bounded_text
from ctxlaunch.contract.spec.secret_refs import (
    EnvFromFile,
    EnvFromSecret,
    EnvFromSubmitter,
    EnvReference,
)

MAX_VALUE_BYTES = 1 << 20
"""The largest file a `from_file` value is read from (1 MiB; a token is a few dozen bytes)."""


class EnvReferenceError(RuntimeError):
    """A referenced value cannot be found where the job starts (nothing was started)."""


def _shell_path(path: str) -> str:
    """A path as one shell word, with a leading `~/` left to the shell (the home directory of
    whoever runs the script)."""
    if path == "~":
        return '"${HOME}"'
    if path.startswith("~/"):
        return '"${HOME}"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def shell_lines(references: dict[str, EnvReference]) -> list[str]:
    """Lines of a bash script (with `set -eu`) that export each referenced value, read when
    the script runs: from its own environment (which sbatch passes on from where it ran) or
    from a file. A missing variable or file stops the script with a message naming it."""
    lines = []
    for name, reference in references.items():
        if isinstance(reference, EnvFromSubmitter):
            source = reference.from_env
            lines.append(
                f'export {name}="${{{source}:?ctxlaunch: fabric.env.{name} takes its value from '
                f'{source}, which is not set in the environment sbatch was run from}}"'
            )
        elif isinstance(reference, EnvFromFile):
            lines.append(f'{name}="$(cat -- {_shell_path(reference.from_file)})"')
            lines.append(f"export {name}")
        else:
            raise ValueError(f"fabric.env.{name}: a Secret's key is read by Kubernetes only")
    return lines


def secret_key_refs(references: dict[str, EnvReference]) -> dict[str, dict[str, str]]:
    """Name -> the container's `valueFrom.secretKeyRef` of each Secret reference."""
    return {
        name: {"name": reference.secret.name, "key": reference.secret.key}
        for name, reference in references.items()
        if isinstance(reference, EnvFromSecret)
    }


def resolve(references: dict[str, EnvReference]) -> dict[str, str]:
    """The referenced values, read now from this process's environment and the files (a job
    started here); EnvReferenceError names the first one missing."""
    values = {}
    for name, reference in references.items():
        if isinstance(reference, EnvFromSubmitter):
            value = os.environ.get(reference.from_env)
            if not value:
                raise EnvReferenceError(
                    f"fabric.env.{name} takes its value from {reference.from_env}, which is not "
                    "set in this environment; export it, then submit again"
                )
            values[name] = value
        elif isinstance(reference, EnvFromFile):
            path = Path(reference.from_file).expanduser()
            try:
                values[name] = read_bounded_text(path, MAX_VALUE_BYTES, "the value's file")
            except BoundedReadError as exc:
                raise EnvReferenceError(f"fabric.env.{name}: {exc}") from None
            values[name] = values[name].rstrip("\n")
        else:
            raise EnvReferenceError(
                f"fabric.env.{name} is a Kubernetes Secret's key: only a Kubernetes job reads it"
            )
    return values
