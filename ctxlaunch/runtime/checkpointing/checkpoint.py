"""Checkpoints: one directory per step, committed by a marker written last, resumed from the
newest committed one.

    <dir>/step-00000100/        the checkpoint of the state after step 100
    <dir>/step-00000100/COMMITTED   written by rank 0 once every rank has finished writing

A checkpoint interrupted halfway (a preemption during the save) has no marker and is ignored,
so the previous one stays the resume point: no checkpointed work is ever lost.

The state itself is written by the engine: `torch.distributed.checkpoint` in a layout-independent
form (ctxlaunch/runtime/checkpointing/reshard.py) for ZeRO-0 and FSDP2, so those resume at other TP,
PP, CP and DP degrees; DeepSpeed's own format under training.engine deepspeed (the default for
ZeRO >= 1 at TP 1 x PP 1; its partitioned fp32 master weights and Adam states have no
torch.distributed.checkpoint form).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ctxlaunch.contract.bounded import MAX_STATE_BYTES, read_bounded_object
from ctxlaunch.runtime.checkpointing.checkpoint_integrity import (
    MARKER_FILES_KEY,
    CheckpointDamaged,
    CheckpointRefused,
    check_dcp_files,
    digest_share,
    verify_share,
)

MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the disk is full); the previous one is intact."""


def disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an error it wraps, is ENOSPC (torch.distributed.checkpoint wraps each
    rank's failure in its own exception)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        stack += [error.__cause__, error.__context__]
    return False


def out_of_space(exc: BaseException, directory: str | Path) -> bool:
    """Whether a failed save ran out of disk: ENOSPC in the error, or (torch's zip writer turns
    a short write into "unexpected pos") less room left than the newest checkpoint takes."""
    if disk_full(exc):
        return True
    latest = latest_step(directory)
    needed = 2**20
    if latest is not None:
        needed = max(
            needed,
            sum(f.stat().st_size for f in step_dir(directory, latest).rglob("*") if f.is_file()),
        )
    try:
        return free_mib(directory) * 2**20 < needed
    except OSError:
        return False


def free_mib(directory: str | Path) -> float:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize / 2**20


class CheckpointDirError(RuntimeError):
    """The checkpoint directory cannot be used; raised at start, before any training."""


def check_writable(directory: str | Path, rank: int) -> Path:
    """Create the directory and write/remove a probe file: fail now, not after an hour."""
    path = Path(directory)
    probe = path / f".write-test-{socket.gethostname()}-{rank}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointDirError(
            f"training.checkpoint.dir {str(path)!r} cannot be written ({exc.strerror or exc}); "
            "fix the path or its permissions"
        ) from None
    return path


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def committed_steps(directory: str | Path) -> list[int]:
    """Steps with a complete checkpoint, oldest first."""
    path = Path(directory)
    if not path.is_dir():
        return []
    steps = []
    for child in path.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(directory: str | Path | None) -> int | None:
    if directory is None:
        return None
    steps = committed_steps(directory)
    return steps[-1] if steps else None


def commit(
    directory: str | Path,
    step: int,
    rank: int,
    keep: int,
    info: dict,
    spare: frozenset[int] = frozenset(),
) -> None:
    """After every rank wrote its part: the ranks hash the step's files between them (each its
    share), rank 0 writes the marker with the sizes and SHA-256s, then prunes old checkpoints
    (never those in `spare`: damaged ones the run skipped, kept for a person to look at)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():
        dist.barrier()
    target = step_dir(directory, step)
    share = digest_share(target, MARKER, rank, world)
    shares: list[Any] = [share]
    if dist.is_initialized():
        shares = [None] * world
        dist.all_gather_object(shares, share)
    if rank == 0:
        files: dict[str, Any] = {}
        for part in shares:
            files.update(part or {})
        marker = target / MARKER
        tmp = target / (MARKER + ".tmp")
        record = {"step": step, **info, MARKER_FILES_KEY: files}
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, marker)
        for old in committed_steps(directory)[:-keep]:
            if old not in spare:
                shutil.rmtree(step_dir(directory, old), ignore_errors=True)
        # Half-written checkpoints older than the one just committed are garbage.
        for child in Path(directory).iterdir():
            match = _STEP_DIR.match(child.name)
            if match and int(match.group(1)) < step and not (child / MARKER).exists():
                shutil.rmtree(child, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def damage(path: Path, rank: int) -> str | None:
    """Why the committed step at `path` differs from the sizes and SHA-256s its marker
    recorded (None: it does not); a collective: each rank checks its share of the files and
    every rank gets the same answer. A marker that predates the record is checked the way
    `export` checks a checkpoint: every data file its metadata names is there and long
    enough (a step cut short before the record existed is skipped too)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        marker = read_bounded_object(path / MARKER, MAX_STATE_BYTES, "the commit marker")
        recorded = marker.get(MARKER_FILES_KEY) or {}
        reason = verify_share(path, MARKER, recorded, rank, world)
        if not recorded and rank == 0 and (path / ".metadata").is_file():
            try:
                check_dcp_files(path)
            except (CheckpointDamaged, CheckpointRefused) as exc:
                reason = str(exc)
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        reason = f"{path / MARKER} cannot be read ({exc})"
    reasons: list[Any] = [reason]
    if dist.is_initialized():
        reasons = [None] * world
        dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r), None)
