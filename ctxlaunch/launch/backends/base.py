"""What every backend offers, and the pieces they share."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Protocol

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.rundir import combine_exit_codes
from ctxlaunch.contract.spec import JobSpec

__all__ = ["Backend", "DryRun", "Status", "combine_exit_codes", "describe_layout"]


@dataclass(frozen=True)
class DryRun:
    """Everything a submission would do, as data: printing it is `--dry-run`, scheduling it is
    the submission."""

    target: str
    spec: JobSpec
    command: list[str]
    """The exact command line that is run (torchrun, sbatch, ...)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment added to the submitter's for that command."""
    artifact: str | None = None
    """The exact bytes submitted (the sbatch script, the manifest), when there is one."""
    artifact_name: str | None = None
    extra_artifacts: dict[str, str] = field(default_factory=dict)
    """Further files submitted with the artifact, by name (the Kubernetes PodMonitor)."""

    def describe(self) -> str:
        lines = [f"# target: {self.target}"]
        for name, value in self.env.items():
            lines.append(f"export {name}={shlex.quote(value)}")
        lines.append(shlex.join(self.command))
        if self.artifact is not None:
            lines.append(f"# --- {self.artifact_name} ---")
            lines.append(self.artifact.rstrip("\n"))
        for name, text in self.extra_artifacts.items():
            lines.append(f"# --- {name} ---")
            lines.append(text.rstrip("\n"))
        return "\n".join(lines) + "\n"


TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED",
                      "OUT_OF_MEMORY", "OOM", "BAD_INPUT"})
"""States a job does not leave (PREEMPTED: Slurm preempted it without requeueing it)."""

WAIT_EXIT = {"COMPLETED": exitcodes.OK, "OOM": exitcodes.OOM, "BAD_INPUT": exitcodes.BAD_INPUT}
"""A final state -> the exit status of `ctxlaunch wait` (anything else failed: 1)."""

EXIT_STATES = {exitcodes.OK: "COMPLETED", exitcodes.OOM: "OOM", exitcodes.BAD_INPUT: "BAD_INPUT",
               exitcodes.PREEMPTED: "PREEMPTED"}
"""A job's exit status -> its state, where the status says more than "failed"."""


@dataclass(frozen=True)
class Status:
    """Where a job stands, in ctxlaunch's states: PENDING, RUNNING, SUSPENDED, COMPLETED,
    FAILED, CANCELLED, TIMEOUT, PREEMPTED, OUT_OF_MEMORY (the host's, as Slurm reports it),
    OOM (the trainer ran out of device memory) and BAD_INPUT (the trainer refused its set-up)."""

    state: str
    scheduler_state: str = ""
    """The scheduler's own word for it (Slurm's JobState)."""
    exit_code: int | None = None
    restarts: int = 0
    reason: str = ""
    nodes: str = ""
    story: str = ""
    """What happened, in words: "PREEMPTED at step 11 and requeued (restart 1 of 3)"."""
    history: tuple[str, ...] = ()
    """How each earlier run ended, oldest first (a requeued job's story so far)."""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def describe_layout(spec: dict) -> str:
    """The layout of a job from its recorded spec (JSON), for an OOM report."""
    p, t = spec.get("parallel", {}), spec.get("training", {})
    return (f"model {spec.get('model', {}).get('preset') or 'custom'}, seq_len "
            f"{t.get('seq_len')}, cp {p.get('cp')} ({p.get('cp_algorithm')}, "
            f"{p.get('layout')}), activation_checkpointing "
            f"{t.get('activation_checkpointing')}, ZeRO-{t.get('zero_stage')}")


class Backend(Protocol):
    name: str

    def dryrun(self, spec: JobSpec) -> DryRun: ...

    def schedule(self, dryrun: DryRun) -> int:
        """Run or submit; returns the exit status for the `submit` command."""

