"""Fault injection for tests, behind an explicit switch: CTXLAUNCH_INJECT_FAULT.

    CTXLAUNCH_INJECT_FAULT="kind=oom,rank=1,step=3"

makes rank 1 fail at the start of step 3 (1-based). Kinds: `oom` raises the allocator's
OutOfMemoryError (a simulated allocation failure: a CPU has no device allocator to exhaust),
`error` raises RuntimeError, `kill` SIGKILLs the process (a dead rank), `kill_in_save` SIGKILLs
it while it writes the checkpoint of that step (after its files, before the commit marker).
`slow` makes every rank sleep `seconds` at the start of every step (`kind=slow,seconds=0.5`):
a job whose length a test can bound from below whatever the machine's speed. `once=PATH`
makes a fault fire in one run of a job only: the first to fire creates PATH, and a fault whose
PATH exists does nothing (a restarted job then runs on; the path holds no commas).
`restart=N` (or `N-M`) makes a fault act in the job's run N (to M) only, 0 being the first (the
restart count Slurm or the local launcher gives the ranks): `kind=slow,seconds=0.5,restart=0`
holds back the first run alone. Unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from ctxlaunch.contract import events

ENV = "CTXLAUNCH_INJECT_FAULT"
KINDS = ("oom", "error", "kill", "kill_in_save", "slow")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 0.0
    once: str | None = None
    """A file whose existence means the fault has fired already (in an earlier run)."""
    restarts: tuple[int, int] | None = None
    """The first and last run (restart count) the fault acts in; None: every run."""

    def _spent(self) -> bool:
        """Whether a fire-once fault fired before; marks it fired otherwise."""
        if self.once is None:
            return False
        try:
            with open(self.once, "x", encoding="utf-8"):
                return False
        except FileExistsError:
            return True

    def _acts_in_this_run(self) -> bool:
        if self.restarts is None:
            return True
        first, last = self.restarts
        return first <= events.restart_count() <= last

    def maybe_fire(self, rank: int, step: int) -> None:
        if not self._acts_in_this_run():
            return
        if self.kind == "slow":
            time.sleep(self.seconds)
            return
        if rank != self.rank or step != self.step or self.kind == "kill_in_save":
            return
        if self._spent():
            return
        if self.kind == "oom":
            raise torch.OutOfMemoryError(
                f"injected by {ENV}: simulated allocation failure on rank {rank} at step {step}"
            )
        if self.kind == "error":
            raise RuntimeError(f"injected by {ENV}: failure on rank {rank} at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)

    def maybe_fire_in_save(self, rank: int, step: int) -> None:
        """Called between writing the checkpoint of `step` and committing it."""
        if not self._acts_in_this_run():
            return
        if self.kind == "kill_in_save" and rank == self.rank and step == self.step:
            if not self._spent():
                os.kill(os.getpid(), signal.SIGKILL)


def from_env(env: dict[str, str] | None = None) -> Fault | None:
    text = (os.environ if env is None else env).get(ENV, "").strip()
    if not text:
        return None
    fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    kind = fields.get("kind", "")
    if kind not in KINDS:
        raise ValueError(f"{ENV}={text!r}: kind must be one of {', '.join(KINDS)}")
    return Fault(
        kind=kind,
        rank=int(fields.get("rank", "0")),
        step=int(fields.get("step", "1")),
        seconds=float(fields.get("seconds", "0")),
        once=fields.get("once"),
        restarts=_restarts(fields["restart"]) if "restart" in fields else None,
    )


def _restarts(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    return int(first), int(last or first)
