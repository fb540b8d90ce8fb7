"""The pieces behind the Slurm fault tests, without a cluster: naming a hung rank from the
heartbeats, telling a full disk from other save errors, and a stop signal caught before the
trainer's loop starts."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ctxlaunch.runtime.trainer import checkpoint, heartbeat, stopsignal


def test_a_stale_heartbeat_names_the_hung_rank(tmp_path: Path) -> None:
    for rank in range(3):
        heartbeat.path(tmp_path, rank).parent.mkdir(parents=True, exist_ok=True)
        heartbeat.path(tmp_path, rank).touch()
    old = time.time() - 30
    os.utime(heartbeat.path(tmp_path, 2), (old, old))
    assert heartbeat.describe_hang(tmp_path, 0, 3, 20) == (
        "rank 2 (silent 30 s) hung: stopped or stuck, not dead; rank 0 gave up waiting for it "
        "after the collective timeout (training.timeout_seconds = 20)")
    os.utime(heartbeat.path(tmp_path, 2))
    assert heartbeat.describe_hang(tmp_path, 0, 3, 20) is None  # a dead peer: no one is hung


def test_disk_full_is_found_in_wrapped_errors(tmp_path: Path) -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as exc:
        assert checkpoint.disk_full(exc)
    assert not checkpoint.disk_full(RuntimeError("connection reset"))
    # Plenty of room here: another error is not called a full disk.
    assert not checkpoint.out_of_space(RuntimeError("unexpected pos 704 vs 598"), tmp_path)


def test_a_stop_signal_during_start_up_does_not_kill_the_rank(tmp_path: Path) -> None:
    code = ("import os, signal, time\n"
            "from ctxlaunch.runtime.trainer import stopsignal\n"
            "stopsignal.install()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "time.sleep(0.1)\n"
            "print(stopsignal.received() == signal.SIGUSR1)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
    assert stopsignal.STOP_SIGNALS == (signal.SIGUSR1, signal.SIGTERM)
