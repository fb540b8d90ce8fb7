"""The pieces behind the Slurm fault tests, without a cluster: naming a hung rank from the
heartbeats, telling a full disk from other save errors, a stop signal caught before the
trainer's loop starts, the collective timeout on the layout's own groups, and injected faults
bound to one run of a job."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ctxlaunch.contract import events
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.cp import comm
from ctxlaunch.runtime.checkpointing import checkpoint
from ctxlaunch.runtime.parallel.context import build_context
from ctxlaunch.runtime.trainer import faults, heartbeat, stopsignal
from ctxlaunch.runtime.trainer.engines import init_deepspeed
from tests.helpers.dist import run_distributed


def test_a_stale_heartbeat_names_the_hung_rank(tmp_path: Path) -> None:
    for rank in range(3):
        heartbeat.path(tmp_path, rank).parent.mkdir(parents=True, exist_ok=True)
        heartbeat.path(tmp_path, rank).touch()
    old = time.time() - 30
    os.utime(heartbeat.path(tmp_path, 2), (old, old))
    assert heartbeat.describe_hang(tmp_path, 0, 3, 20) == (
        "rank 2 (silent 30 s) hung: stopped or stuck, not dead; rank 0 gave up waiting for it "
        "after the collective timeout (training.timeout_seconds = 20)"
    )
    os.utime(heartbeat.path(tmp_path, 2))
    assert heartbeat.describe_hang(tmp_path, 0, 3, 20) is None  # a dead peer: no one is hung


def test_a_fault_bound_to_a_restart_acts_in_that_run_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fault = faults.from_env({faults.ENV: "kind=error,rank=0,step=2,restart=1"})
    assert fault is not None and fault.restarts == (1, 1)
    for count in ("0", "2"):
        monkeypatch.setenv(events.RESTART_COUNT_ENV, count)
        fault.maybe_fire(0, 2)  # another run: nothing
    monkeypatch.setenv(events.RESTART_COUNT_ENV, "1")
    fault.maybe_fire(0, 1)  # another step: nothing
    with pytest.raises(RuntimeError, match="injected by CTXLAUNCH_INJECT_FAULT"):
        fault.maybe_fire(0, 2)
    unbound = faults.from_env({faults.ENV: "kind=error,rank=0,step=2"})
    assert unbound is not None and unbound.restarts is None
    with pytest.raises(RuntimeError):
        unbound.maybe_fire(0, 2)
    ranged = faults.from_env({faults.ENV: "kind=error,rank=0,step=2,restart=0-1"})
    assert ranged is not None and ranged.restarts == (0, 1)
    with pytest.raises(RuntimeError):
        ranged.maybe_fire(0, 2)  # restart 1
    monkeypatch.setenv(events.RESTART_COUNT_ENV, "2")
    ranged.maybe_fire(0, 2)  # past the range: nothing


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
    code = (
        "import os, signal, time\n"
        "from ctxlaunch.runtime.trainer import stopsignal\n"
        "stopsignal.install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.1)\n"
        "print(stopsignal.received() == signal.SIGUSR1)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
    assert stopsignal.STOP_SIGNALS == (signal.SIGUSR1, signal.SIGTERM)


def _wait_beside_a_silent_peer(
    rank: int, world_size: int, group: str, answered: str, timeout_s: int
) -> str | None:
    comm.set_wait_timeout(timeout_s)  # what the trainer does before it builds its groups
    if group == "deepspeed":  # ZeRO's gradients go over DeepSpeed's own copy of the world
        from deepspeed.utils import groups

        init_deepspeed("gloo")
        target = groups._get_data_parallel_group()
    else:
        ctx = build_context(
            ParallelDims(
                dp=2 if group == "dp" else 1,
                cp=2 if group == "cp" else 1,
                tp=2 if group == "tp" else 1,
                pp=2 if group == "pp" else 1,
            ),
            rank=rank,
        )
        target = getattr(ctx, f"{group}_group")
    if rank == 1:  # alive and silent until rank 0 has its answer (at most a minute)
        deadline = time.monotonic() + 60
        while not Path(answered).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    try:
        if group == "pp":  # the pipeline's stages talk point to point, waited with no deadline
            dist.recv(torch.empty(1), src=1, group=target)
        else:
            dist.all_reduce(torch.ones(1), group=target)
        return "completed"
    except RuntimeError as exc:
        return str(exc)
    finally:
        Path(answered).touch()


@pytest.mark.parametrize("group", ["cp", "tp", "dp", "pp", "deepspeed"])
def test_a_silent_peer_times_out_the_layouts_groups_too(tmp_path: Path, group: str) -> None:
    """A subgroup takes torch's default timeout (30 minutes on gloo), not the job's, unless it
    is given one: rank 1 stays silent, and rank 0's all-reduce (PP: receive) on the group must
    fail after the job's 3 s, not once rank 1 gives up a minute later (a closed connection)."""
    rank0, _ = run_distributed(
        _wait_beside_a_silent_peer, 2, group, str(tmp_path / "answered"), 3, timeout_s=120
    )
    assert isinstance(rank0, str) and "Timed out" in rank0, rank0
