"""Which rank hangs: every rank touches its own heartbeat file every second from a thread.

A rank that is stopped or hung in the kernel (SIGSTOP, a dead NFS mount) stops touching its file;
a rank merely blocked in a collective keeps touching it (the collective waits without the GIL).
When a collective times out, the rank that gave up names the ranks whose heartbeat went stale,
so the job ends with the hung rank named rather than "timed out" on every rank.

    <run dir>/heartbeat/rank-<N>     mtime = the rank's last sign of life
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

INTERVAL_SECONDS = 1.0
STALE_SECONDS = 5.0


def path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "heartbeat" / f"rank-{rank}"


def start(run_dir: Path, rank: int) -> None:
    """Touch this rank's heartbeat now and every INTERVAL_SECONDS, from a daemon thread."""
    beat = path(run_dir, rank)
    beat.parent.mkdir(parents=True, exist_ok=True)

    def loop() -> None:
        while True:
            try:
                beat.touch()
            except OSError:
                pass  # a full or flaky disk must not kill training; the check says "unknown"
            time.sleep(INTERVAL_SECONDS)

    beat.touch()
    threading.Thread(target=loop, name="ctxlaunch-heartbeat", daemon=True).start()


def stale_ranks(run_dir: Path, world_size: int, now: float | None = None) -> dict[int, float]:
    """Ranks whose heartbeat is older than STALE_SECONDS (or missing: inf) -> seconds since."""
    now = time.time() if now is None else now
    stale: dict[int, float] = {}
    for rank in range(world_size):
        try:
            age = now - os.stat(path(run_dir, rank)).st_mtime
        except OSError:
            age = float("inf")
        if age > STALE_SECONDS:
            stale[rank] = age
    return stale


def describe_hang(run_dir: Path, rank: int, world_size: int, timeout_seconds: int) -> str | None:
    """The error line naming the hung ranks, or None when every other rank is alive."""
    stale = {r: age for r, age in stale_ranks(run_dir, world_size).items() if r != rank}
    if not stale:
        return None
    names = ", ".join(
        f"rank {r} ({'no heartbeat' if age == float('inf') else f'silent {age:.0f} s'})"
        for r, age in sorted(stale.items())
    )
    return (
        f"{names} hung: stopped or stuck, not dead; rank {rank} gave up waiting for it after "
        f"the collective timeout (training.timeout_seconds = {timeout_seconds})"
    )
