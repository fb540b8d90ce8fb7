"""A rank never outlives the command that started it (ctxlaunch.contract.lifeline,
ctxlaunch.runtime.tether), and a checkpoint directory has one writer while it lives
(ctxlaunch.contract.dirlock): real processes, killed with SIGKILL. The full path (a SIGKILLed
`ctxlaunch submit` with torchrun and two ranks, a second job on its directory) is
test_local.py's; these check each hold on its own, in a second or two."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ctxlaunch.contract.lifeline import LAUNCHER_ENV, ProcessId, this_process

RANK = (
    "import time\n"
    "from ctxlaunch.runtime import tether\n"
    "tether.hold_to_launcher(poll_seconds=0.1)\n"
    "print('holding', flush=True)\n"
    "time.sleep(120)\n"
)
"""A stand-in for a rank's start: what the trainer's and eval's entries call first."""


def _gone_within(process: subprocess.Popen[str], seconds: float) -> int | None:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


def test_a_process_is_named_by_pid_and_start_time() -> None:
    """A pid the kernel gave to another process since is not the launcher."""
    me = this_process()
    assert me.pid == os.getpid() and me.alive()
    assert ProcessId.parse(str(me)) == me
    assert not ProcessId(me.pid, me.start + 1).alive()
    assert ProcessId.parse("12:x") is None and ProcessId.parse(None) is None


@pytest.mark.timeout(60)
def test_a_rank_ends_when_its_launcher_is_killed_and_never_starts_without_it() -> None:
    launcher = subprocess.Popen(["sleep", "120"])
    named = ProcessId(launcher.pid, _start_of(launcher.pid))
    env = {**os.environ, LAUNCHER_ENV: str(named)}
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "holding\n"
        launcher.kill()
        launcher.wait()
        assert _gone_within(rank, 10) == 1
    finally:
        for process in (launcher, rank):
            if process.poll() is None:
                process.kill()
                process.wait()
    # Its launcher gone before it started: it ends at once, never running the job.
    late = subprocess.run(
        [sys.executable, "-c", RANK], env=env, capture_output=True, text=True, timeout=30
    )
    assert late.returncode == 1 and "holding" not in late.stdout


@pytest.mark.timeout(60)
def test_a_launchers_child_dies_with_it_even_in_a_session_of_its_own() -> None:
    """The parent-death signal, set in the child before it runs (what `submit` does for
    torchrun), ends the child when the launcher is SIGKILLed, though the child is in another
    session (as torchrun puts each rank)."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "from ctxlaunch.contract.lifeline import child_of\n"
            "child = subprocess.Popen(['sleep', '120'], start_new_session=True,\n"
            "                         preexec_fn=child_of(os.getpid()))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    try:
        assert _alive(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _start_of(pid: int) -> int:
    text = open(f"/proc/{pid}/stat").read()
    return int(text[text.rfind(")") + 2 :].split()[19])


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but unreaped by its new parent, does not)."""
    try:
        text = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return text[text.rfind(")") + 2 :].split()[0] not in ("Z", "X")


HOLDER = (
    "import sys, time\n"
    "from ctxlaunch.contract import dirlock\n"
    "dirlock.hold(sys.argv[1], sys.argv[2])\n"
    "print('held', flush=True)\n"
    "time.sleep(float(sys.argv[3]))\n"
)
"""A stand-in for a job's first rank: it holds the checkpoint directory for a while."""


@pytest.mark.timeout(60)
def test_a_checkpoint_directory_has_one_writer_until_it_ends(tmp_path) -> None:
    """Another job is refused at once, naming the holder; the same job's next run (a requeue
    starting before the filesystem let go) waits for it; once the holder has ended, however it
    ended, the directory is free: the kernel released the lock, nobody cleans up."""
    from ctxlaunch.contract import dirlock

    directory = tmp_path / "ckpt"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), "job-a", "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        found = dirlock.holder(directory)
        assert found is not None and (found.job, found.pid) == ("job-a", first.pid)
        with pytest.raises(dirlock.DirectoryInUse) as refused:
            dirlock.hold(directory, "job-b")
        assert f"is in use by job job-a (host {found.host}, pid {first.pid}, since " in str(
            refused.value
        )
        again = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(directory), "job-a", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.5)
        assert again.poll() is None  # waiting for the first run, not refused
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert again.stdout is not None and again.stdout.readline() == "held\n"
        assert again.wait(timeout=30) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert dirlock.holder(directory) is None
