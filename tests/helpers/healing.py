"""Reading a healing job's run back (training.heal): its events, its losses by step (and their
comparison with a fresh run's), and the figures RELIABILITY.md reports for each fault (steps
lost, time from the fault to the first step after it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ctxlaunch.contract import events

RESUME_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
"""tests/unit/test_trainer_4d.py's tolerance for losses resumed at another layout."""


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each step's loss from metrics.jsonl (in a run or job directory); a step trained twice
    (before a fault and again after the resume) keeps its last value, the healed run's."""
    path = run_dir / "metrics.jsonl"
    losses: dict[int, float] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        losses[int(record["step"])] = float(record["loss"])
    return losses


def replans(run_dir: Path) -> list[events.Event]:
    """The run's `replanned` events, oldest first."""
    return [e for e in events.read_events(run_dir) if e.kind == events.REPLANNED]


def first_step_after(run_dir: Path, moment: float) -> events.Event | None:
    """The first `step` event written after `moment` (unix seconds)."""
    return next(
        (
            e
            for e in events.read_events(run_dir)
            if e.kind == events.STEP and e.time_seconds > moment
        ),
        None,
    )


def last_step_before(run_dir: Path, moment: float) -> int:
    """The newest step logged before `moment` (unix seconds): what the faulted run reached."""
    steps = [
        int(e.get("step"))
        for e in events.read_events(run_dir)
        if e.kind == events.STEP and e.time_seconds <= moment
    ]
    return steps[-1] if steps else 0


def figures_line(fault: str, **figures: object) -> str:
    """The line a healing test prints for RELIABILITY.md (run pytest with -s to see it)."""
    return "HEAL-FIGURES " + json.dumps({"fault": fault, **figures}, sort_keys=True)


def replanned_figures_line(
    fault: str, replanned: events.Event, first: events.Event, fault_time: float, reached: int
) -> str:
    """`figures_line` for a run re-planned after an OOM that struck before any checkpoint:
    `first` is the first step after the re-plan, `fault_time` when the rank was killed."""
    return figures_line(
        fault,
        steps_lost=reached - replanned.get("step"),
        checkpointed_steps_lost=0,
        seconds_fault_to_first_step=round(first.time_seconds - fault_time, 1),
        reached=reached,
        resumed=replanned.get("step"),
        now=replanned.get("to")["layout"],
    )


def assert_same_losses(healed: dict[int, float], fresh: dict[int, float], steps: range) -> None:
    """The healed run's losses over `steps` equal a fresh run's, within RESUME_TOLERANCE."""
    torch.testing.assert_close(
        torch.tensor([healed[s] for s in steps], dtype=torch.float64),
        torch.tensor([fresh[s] for s in steps], dtype=torch.float64),
        **RESUME_TOLERANCE,
    )
