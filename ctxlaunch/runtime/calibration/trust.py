"""Whether a CPU calibration can be trusted: what else ran on the cores while it measured, and
whether its readings agree with each other.

A calibration measures rates with every core and with one thread, each several times. On a
machine that other processes keep busy, the all-core rates fall by the share those processes
take, the readings scatter, and the all-core rate can even read below one thread's; every
prediction made from such rates is off by as much. `judge` names each such sign; `ctxlaunch
calibrate` saves nothing while there is one, unless told to.

Others' load is counted from the kernel's own accounting: the CPU time /proc/stat says every
core spent busy, less the CPU time of this process and its finished children (getrusage),
over the wall time between two readings."""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_CORES_LIMIT = 0.5
"""Others' busy cores (CPU seconds per second) above which the machine is not the calibration's:
half a core. A quiet machine's daemons take a few hundredths; one busy loop takes a whole core,
which takes 1/N of an N-core machine's all-core rates."""
MAX_SPREAD = 0.25
"""The most a rate's readings may spread ((max - min) / median) before they disagree: on a quiet
machine the readings of one rate agree within a few per cent; a quarter is a minute of someone
else's work in one of them."""
ALL_CORES_FLOOR = 0.9
"""An all-core rate below this share of the one-thread rate contradicts itself: more cores never
compute slower unless something else holds them (10 % for timer noise)."""
STAT = Path("/proc/stat")


def busy_cpu_seconds(stat: Path = STAT) -> tuple[float, float] | None:
    """(CPU seconds every core spent busy, CPU seconds in all) since boot, from /proc/stat's
    first line; None where it cannot be read (not Linux)."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + ticks[4]
    per_second = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / per_second, sum(ticks) / per_second


def own_cpu_seconds() -> float:
    """CPU seconds this process and its finished children have used."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class LoadWatch:
    """Others' CPU use from `start` on: `others_cores()` is their busy cores on average (CPU
    seconds per wall second); None where the kernel's accounting cannot be read."""

    busy: float | None = None
    own: float = 0.0
    wall: float = 0.0

    def start(self) -> LoadWatch:
        reading = busy_cpu_seconds()
        self.busy = reading[0] if reading else None
        self.own = own_cpu_seconds()
        self.wall = time.monotonic()
        return self

    def others_cores(self) -> float | None:
        reading = busy_cpu_seconds()
        if reading is None or self.busy is None:
            return None
        elapsed = time.monotonic() - self.wall
        if elapsed <= 0:
            return None
        others = (reading[0] - self.busy) - (own_cpu_seconds() - self.own)
        return max(others, 0.0) / elapsed


def others_busy_cores(seconds: float = 1.0) -> float | None:
    """Others' busy cores over the next `seconds`, while this process only waits."""
    watch = LoadWatch().start()
    time.sleep(seconds)
    return watch.others_cores()


def spread(values: list[float]) -> float:
    """(max - min) / median of a rate's readings; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


def judge(
    *,
    others_cores: float | None,
    cores: int,
    readings: dict[str, list[float]] | None = None,
    all_cores: dict[str, float] | None = None,
    one_thread: dict[str, float] | None = None,
) -> list[str]:
    """Each reason not to trust a calibration, as a sentence naming what was seen: others' busy
    cores over BUSY_CORES_LIMIT, a rate whose readings spread past MAX_SPREAD, an all-core rate
    below ALL_CORES_FLOOR of its one-thread rate. Empty: nothing was seen against it."""
    reasons = []
    if others_cores is not None and others_cores > BUSY_CORES_LIMIT:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        reasons.append(
            f"other processes kept {others_cores:.1f} of the {cores} cores busy"
            + (f" (load average {load:.1f})" if load is not None else "")
        )
    for name, values in (readings or {}).items():
        if spread(values) > MAX_SPREAD:
            shown = ", ".join(f"{v:.3g}" for v in values)
            reasons.append(
                f"the {name} readings disagree ({shown}: {spread(values):.0%} apart, more than "
                f"the {MAX_SPREAD:.0%} they agree within on a quiet machine)"
            )
    for name, rate in (all_cores or {}).items():
        single = (one_thread or {}).get(name)
        if single and rate < ALL_CORES_FLOOR * single:
            reasons.append(
                f"the all-core {name} rate ({rate / 1e9:.1f} G/s) is below one thread's "
                f"({single / 1e9:.1f} G/s)"
            )
    return reasons
