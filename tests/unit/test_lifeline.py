"""A rank never outlives the command that started it (ctxlaunch.contract.lifeline,
ctxlaunch.runtime.tether): real processes, killed with SIGKILL. The full path (a SIGKILLed
`ctxlaunch submit` with torchrun and two ranks) is test_local.py's; these check each hold on
its own, in a second or two."""

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
