"""A job's processes live no longer than the process that started them.

`ctxlaunch submit` (a local job) and `ctxlaunch eval` start torchrun, whose agent starts each
rank in a session of its own: a SIGKILL to the command (a closed terminal, a batch system
ending the shell that ran it) would leave the ranks training and writing checkpoints with
nobody to record how the job ends. Three things hold them to it, on Linux:

- the launcher starts torchrun with the parent-death signal set (PR_SET_PDEATHSIG: SIGKILL
  when the launcher dies), and each rank sets it for itself as it starts (SIGKILL when the
  torchrun agent that started it dies);
- a rank's parent may have died before the rank could set it (the signal is not sent then), so
  the rank names its launcher's process (pid and start time, in LAUNCHER_ENV) and checks it
  right after setting the signal; then
- a watchdog thread in the rank checks the launcher each second and ends the rank when it has
  gone, whatever the process tree became in between.

A process is named by its pid and its start time (/proc/PID/stat), so a pid the kernel gave
to another process since is never taken for the launcher. Elsewhere than Linux the parent-death
signal is not available, and the watchdog alone holds the ranks.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LAUNCHER_ENV = "CTXLAUNCH_LAUNCHER"
"""The process that started the job (`ctxlaunch submit` or `eval`), as `pid:start`: a rank
ends when it is gone."""

_PR_SET_PDEATHSIG = 1
"""prctl(2)'s option number (linux/prctl.h)."""


@dataclass(frozen=True)
class ProcessId:
    """A process, named so that a reused pid is never mistaken for it."""

    pid: int
    start: int
    """Its start time in clock ticks after boot (/proc/PID/stat's 22nd field); 0 unknown."""

    def __str__(self) -> str:
        return f"{self.pid}:{self.start}"

    @classmethod
    def parse(cls, text: str | None) -> ProcessId | None:
        """`pid:start` back into a ProcessId (None for anything else)."""
        pid, _, start = (text or "").partition(":")
        if not (pid.isdigit() and start.isdigit()) or len(text or "") > 40:
            return None
        return cls(int(pid), int(start))

    def alive(self) -> bool:
        """Whether this very process still runs (a zombie, dead but not yet reaped, counts as
        gone: it runs nothing)."""
        stat = _stat(self.pid)
        if stat is None:
            if not Path("/proc/self/stat").exists():  # no /proc: ask the kernel for the pid
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    return False
                except PermissionError:
                    return True
                return True
            return False
        state, start = stat
        return state not in ("Z", "X") and (self.start == 0 or start == self.start)


def this_process() -> ProcessId:
    """The running process's name."""
    stat = _stat(os.getpid())
    return ProcessId(os.getpid(), stat[1] if stat else 0)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of `pid` from /proc, None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread ends; False where it
    cannot (not Linux). Kept across exec: a launcher sets it in the child before torchrun
    starts."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def launcher_env() -> dict[str, str]:
    """The variable that names this process as the launcher of the ranks it starts."""
    return {LAUNCHER_ENV: str(this_process())}


def child_of(parent: int) -> Callable[[], None]:
    """A `preexec_fn` for a launcher's child (torchrun): it dies with the launcher, and ends at
    once if the launcher is gone already (the parent-death signal is only sent for a death
    after it was set)."""

    def hold() -> None:
        die_with_parent()
        if os.getppid() != parent:
            os._exit(1)

    return hold
