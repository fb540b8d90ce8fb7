"""One writer per checkpoint directory.

Two jobs given one `training.checkpoint.dir` would both run and the second would overwrite the
first's committed steps. A job's first rank therefore takes a lock on the directory for the
job's life: an exclusive POSIX record lock (fcntl) on a file in it, which the kernel releases
when the process ends however it ends (a SIGKILL, the OOM killer, a dead node's lease
expiring), so no stale lock is ever left to clear by hand. POSIX locks rather than flock:
they are the ones NFS (v3 through its lock manager, v4 in the protocol) and Lustre (with its
default `flock`/`localflock` mount options both map them) carry between hosts, where flock
can be local to each client. The lock file also says who holds it (job, host, pid, since
when), for the sentence the next job gets.

A POSIX lock belongs to the process, and closing any descriptor of the file drops it: the
descriptor taken here is kept open for the process's life and the file is opened nowhere else
in that process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = ".ctxlaunch-writer"
"""The lock file in a checkpoint directory; its text names the holder."""

_HELD: dict[str, int] = {}
"""Directories this process holds -> the open descriptor that holds each (never closed)."""

NOT_SUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
"""What a filesystem without record locks answers (an NFS mount with `nolock`, Lustre mounted
with `noflock`)."""


class DirectoryInUse(RuntimeError):
    """Another live process holds the directory; the message names it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a checkpoint directory."""

    job: str
    host: str
    pid: int
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"job {self.job} (host {self.host}, pid {self.pid}, since {when})"


def hold(directory: str | Path, job: str) -> bool:
    """Take `directory` (made if needed) for this process until it ends: DirectoryInUse naming
    the holder when another process has it. False, taking nothing, where the filesystem has
    no record locks (the caller says so); OSError when the lock file cannot be made."""
    path = Path(directory) / LOCK_FILE
    if str(path) in _HELD:
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in NOT_SUPPORTED:
            return False
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise DirectoryInUse(_in_use(directory, read_holder(path))) from None
        raise
    me = Holder(job=job, host=socket.gethostname(), pid=os.getpid(), since=time.time())
    text = json.dumps(me.__dict__).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)
    _HELD[str(path)] = fd
    return True


def holder(directory: str | Path) -> Holder | None:
    """Who holds `directory` now (None: nobody; a lock file left by a process that ended holds
    nothing). Asks the kernel without taking the lock."""
    path = Path(directory) / LOCK_FILE
    if str(path) in _HELD:
        return None  # this process: not "another job"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return read_holder(path) or Holder("unknown", "unknown host", 0, 0.0)
        return None
    finally:
        os.close(fd)  # releases the probe's lock, if it got one
    return None


def check_free(directory: str | Path) -> None:
    """DirectoryInUse naming the holder when another process holds `directory`."""
    found = holder(directory)
    if found is not None:
        raise DirectoryInUse(_in_use(directory, found))


def read_holder(path: Path) -> Holder | None:
    """The holder a lock file names (None when it names none: a file cut short, or foreign)."""
    try:
        with open(path, "rb") as stream:
            data = json.loads(stream.read(4096))
        return Holder(
            job=str(data["job"])[:200],
            host=str(data["host"])[:200],
            pid=int(data["pid"]),
            since=float(data["since"]),
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _in_use(directory: str | Path, found: Holder | None) -> str:
    who = found.describe() if found is not None else "another job"
    return (
        f"training.checkpoint.dir {directory} is in use by {who}: two jobs writing one "
        "checkpoint directory overwrite each other's steps; wait for that job to end, or give "
        "this one a directory of its own"
    )
