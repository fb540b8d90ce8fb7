"""What a run got, read where it runs: the memory each rank may use.

On a GPU that is the device's memory. On the CPU it is the memory limit the run lives under,
which is what the kernel's OOM killer enforces: Slurm's --mem (task/cgroup puts each step in a
memory cgroup), a pod's memory limit (its container's cgroup), else the host's memory; shared
by the node's ranks, less what the processes beside them hold (a PyTorchJob pod's torchrun
agent and pod entry are charged to the same limit).

A process's memory cgroup is the one /proc/self/cgroup names (v1: the `memory` controller's
line; v2: the unified `0::` line) under /sys/fs/cgroup; inside a container without its own
cgroup namespace the mount shows the container's cgroup at its root instead, so both places
are read and the smallest limit found on the way up wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60
"""cgroup v1 reports "no limit" as a page-rounded LONG_MAX; anything above this is none."""


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory limit over this process, and the cgroup that sets it."""

    limit_bytes: int
    directory: Path


def _own_cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(the v1 memory controller's path, the v2 unified path) from /proc/<pid>/cgroup."""
    v1 = v2 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "" and line.startswith("0::"):
            v2 = path
    return v1, v2


def _limit_file(directory: Path) -> int | None:
    for name, unlimited in (("memory.limit_in_bytes", None), ("memory.max", "max")):
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue
        if text == unlimited:
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return value if value < UNLIMITED else None
    return None


def memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path | None = None) -> MemoryLimit | None:
    """The smallest memory limit over this process (its cgroup and the cgroups above it), or
    None where none is set or none can be read."""
    proc_cgroup = proc_cgroup or Path("/proc/self/cgroup")
    v1, v2 = _own_cgroup_paths(proc_cgroup)
    candidates: list[Path] = []
    for base, path in ((root / "memory", v1), (root, v2)):
        if path is None:
            continue
        directory = base / path.lstrip("/")
        while True:
            candidates.append(directory)
            if directory == base:
                break
            directory = directory.parent
        candidates.append(base)  # a container's own cgroup, shown at the mount's root
    best: MemoryLimit | None = None
    for directory in candidates:
        if not directory.is_dir():
            continue
        limit = _limit_file(directory)
        if limit is not None and (best is None or limit < best.limit_bytes):
            best = MemoryLimit(limit, directory)
    return best


def _pids_under(directory: Path) -> set[int]:
    """Every process in a cgroup and the cgroups below it."""
    pids: set[int] = set()
    for procs in directory.rglob("cgroup.procs"):
        try:
            pids.update(int(p) for p in procs.read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def _status_field_bytes(pid: int, names: tuple[str, ...]) -> int:
    """The sum of /proc/<pid>/status fields (kB) named, in bytes; 0 for a process gone."""
    total = 0
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        key, _, value = line.partition(":")
        if key in names:
            total += int(value.split()[0]) * 1024
    return total


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def charged_beside_ranks(directory: Path, pid: int | None = None) -> int:
    """What the processes in the limit's cgroup other than this node's ranks hold of it (the
    launcher: torchrun's agent, the pod entry): their anonymous and shared memory. The ranks
    are this process and its siblings (torchrun and srun start every local rank from one
    parent); memory-mapped files are the ranks' runtime too, counted in the planner's own
    allowance, so only the other processes' own memory is subtracted."""
    pid = pid or os.getpid()
    parent = _parent(pid)
    others = 0
    for other in _pids_under(directory):
        if other == pid or (parent is not None and _parent(other) == parent):
            continue
        others += _status_field_bytes(other, ("RssAnon", "RssShmem"))
    return others


def host_memory_bytes() -> int:
    """The machine's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_rank_capacity_bytes(local_ranks: int) -> tuple[int, MemoryLimit | None]:
    """(the memory one CPU rank may use, the limit it comes from): the memory limit (else the
    host's memory) less what the processes beside the ranks hold, shared by the node's
    `local_ranks` ranks."""
    limit = memory_limit()
    if limit is None:
        return host_memory_bytes() // max(local_ranks, 1), None
    usable = limit.limit_bytes - charged_beside_ranks(limit.directory)
    return max(usable, 0) // max(local_ranks, 1), limit
