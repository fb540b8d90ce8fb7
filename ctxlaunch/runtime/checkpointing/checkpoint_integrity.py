"""Whether a checkpoint step directory is intact, and what to say when it is not.

At commit time every file of the step gets its size and SHA-256 recorded in the COMMITTED
marker (each rank hashes its share of the files, so a large checkpoint is hashed in parallel).
Before a checkpoint is read, `verify` compares the files with that record, and for
torch.distributed.checkpoint `check_dcp_files` reads the metadata through the allow-list
(safe_unpickle.py) and checks that every file it places data in exists and is long enough.
What fails becomes a `CheckpointDamaged` naming the file and the reason, never torch's or
DeepSpeed's traceback.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ctxlaunch.runtime.checkpointing.safe_unpickle import (
    CheckpointDamaged,
    CheckpointRefused,
    load_failure,
    read_metadata_file,
)

__all__ = [
    "CheckpointDamaged",
    "CheckpointRefused",
    "check_dcp_files",
    "digest_share",
    "load_failure",
    "verify_share",
]

MARKER_FILES_KEY = "files"
"""The COMMITTED marker's record of the step's files: {relative path: [bytes, sha256 hex]}."""

CHUNK_BYTES = 8 << 20


def step_files(step: Path, marker: str) -> list[str]:
    """The step directory's files (relative paths, sorted), leaving out the marker and the
    temporary files a writer may leave."""
    return sorted(
        str(path.relative_to(step))
        for path in step.rglob("*")
        if path.is_file() and path.name not in (marker, marker + ".tmp")
    )


def file_digest(path: Path) -> list[Any]:
    """[size in bytes, SHA-256 hex] of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return [size, digest.hexdigest()]


def digest_share(step: Path, marker: str, rank: int, world: int) -> dict[str, list[Any]]:
    """Size and SHA-256 of this rank's share of the step's files (every world-th, from rank)."""
    names = step_files(step, marker)
    return {name: file_digest(step / name) for name in names[rank::world]}


def verify_share(
    step: Path, marker: str, recorded: dict[str, Any], rank: int, world: int
) -> str | None:
    """Why this rank's share of the step's files differs from the record made at commit time
    (None: it does not). A file missing from the directory is found by every rank's share of
    the record; one added since is not damage."""
    names = sorted(recorded)
    for name in names[rank::world]:
        path = step / name
        want_size, want_sha = recorded[name]
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if size != want_size:
            return f"{path} is {size:,} bytes, {want_size:,} when it was committed"
        if file_digest(path)[1] != want_sha:
            return f"{path} changed since it was committed (its SHA-256 differs)"
    return None


def check_dcp_files(step: Path) -> Any:
    """The step's torch.distributed.checkpoint metadata, read through the allow-list, after
    checking that every file it places data in exists and holds the bytes it names."""
    metadata_path = step / ".metadata"
    try:
        metadata = read_metadata_file(metadata_path)
    except OSError as exc:
        raise CheckpointDamaged(f"{metadata_path}: cannot be read ({exc.strerror})") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).is_absolute() or ".." in relative:
            raise CheckpointDamaged(f"{metadata_path}: names a data file outside the checkpoint")
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        ends[relative] = max(ends.get(relative, 0), end)
    for relative, end in sorted(ends.items()):
        path = step / relative
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointDamaged(
                f"{path} is missing (the checkpoint's metadata places data in it)"
            ) from None
        if size < end:
            raise CheckpointDamaged(
                f"{path} is cut short: {size:,} bytes, but the checkpoint's metadata places data "
                f"up to byte {end:,}"
            )
    return metadata
