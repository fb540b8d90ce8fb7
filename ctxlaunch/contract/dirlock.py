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


SAME_JOB_WAIT_SECONDS = 180.0
"""How long a job waits for its own earlier run to let go of the directory: a requeued run can
start before the filesystem has released the lock of a run on a node that died (an NFSv4
lease lasts 90 s by default). Another job is refused at once."""


def hold(directory: str | Path, job: str, same_job_wait: float = SAME_JOB_WAIT_SECONDS) -> bool:
    """Take `directory` (made if needed) for this process until it ends: DirectoryInUse naming
    the holder when another process has it (after up to `same_job_wait` seconds when the
    holder is an earlier run of `job`). False, taking nothing, where the filesystem has no
    record locks (the caller says so); OSError when the lock file cannot be made."""
    path = Path(directory) / LOCK_FILE
    if str(path) in _HELD:
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + same_job_wait
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            os.close(fd)
            if exc.errno in NOT_SUPPORTED:
                return False
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            found = read_holder(path)
            if found is None or found.job != job or time.monotonic() > deadline:
                raise DirectoryInUse(_in_use(directory, found)) from None
            time.sleep(1.0)
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
