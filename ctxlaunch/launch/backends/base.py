"""What every backend offers, and the pieces they share.

`Backend` covers the whole life of a job: its dry run, scheduling it (alone or as part of a
sweep), its status, logs and cancellation, and what to tell a user about a failure. The CLI
and sweeps call only these methods, so they never ask which target a job runs on; each
backend's own settings come in as its typed options (KubernetesOptions), never as attributes
set from outside."""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.rundir import RESULT_LINE, TRAINING, JobEntry, combine_exit_codes
from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.launch.jobstore import JobRecord

__all__ = [
    "Backend",
    "BackendOptions",
    "DryRun",
    "KubernetesOptions",
    "OptionsError",
    "Refused",
    "Status",
    "SweepJobs",
    "combine_exit_codes",
    "describe_layout",
]


@dataclass(frozen=True)
class DryRun:
    """Everything a submission would do, as data: printing it is `--dry-run`, scheduling it is
    the submission."""

    target: str
    spec: JobSpec
    job_id: str
    """ctxlaunch's id of the job this dry run becomes when scheduled (its record's id)."""
    command: list[str]
    """The exact command line that is run (torchrun, sbatch, ...)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment added to the submitter's for that command."""
    artifact: str | None = None
    """The exact bytes submitted (the sbatch script, the manifest), when there is one."""
    artifact_name: str | None = None
    extra_artifacts: dict[str, str] = field(default_factory=dict)
    """Further files submitted with the artifact, by name (the Kubernetes PodMonitor)."""
    entry: JobEntry = TRAINING
    """What the job runs (the trainer, or another job entry such as the calibration)."""
    env_references: dict[str, Any] = field(default_factory=dict)
    """Variables whose value is read when the job starts (a local job: from ctxlaunch's own
    environment or a file), by name; never held here."""

    def describe(self) -> str:
        """What `submit --dry-run` prints: the environment, the command and the bytes."""
        from ctxlaunch.launch.env_references import shell_lines

        lines = [f"# target: {self.target}"]
        for name, value in self.env.items():
            lines.append(f"export {name}={shlex.quote(value)}")
        lines += shell_lines(self.env_references)
        lines.append(shlex.join(self.command))
        if self.artifact is not None:
            lines.append(f"# --- {self.artifact_name} ---")
            lines.append(self.artifact.rstrip("\n"))
        for name, text in self.extra_artifacts.items():
            lines.append(f"# --- {name} ---")
            lines.append(text.rstrip("\n"))
        return "\n".join(lines) + "\n"


TERMINAL = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "OOM",
        "BAD_INPUT",
        "LOST",
    }
)
"""States a job does not leave (PREEMPTED: Slurm preempted it without requeueing it; LOST: a
local job whose launcher ended without recording how the job ended)."""

WAIT_EXIT = {"COMPLETED": exitcodes.OK, "OOM": exitcodes.OOM, "BAD_INPUT": exitcodes.BAD_INPUT}
"""A final state -> the exit status of `ctxlaunch wait` (anything else failed: 1)."""

EXIT_STATES = {
    exitcodes.OK: "COMPLETED",
    exitcodes.OOM: "OOM",
    exitcodes.BAD_INPUT: "BAD_INPUT",
    exitcodes.PREEMPTED: "PREEMPTED",
}
"""A job's exit status -> its state, where the status says more than "failed"."""


@dataclass(frozen=True)
class Status:
    """Where a job stands, in ctxlaunch's states: PENDING, RUNNING, SUSPENDED, COMPLETED,
    FAILED, CANCELLED, TIMEOUT, PREEMPTED, OUT_OF_MEMORY (the host's, as Slurm reports it),
    OOM (the trainer ran out of device memory), BAD_INPUT (the trainer refused its set-up) and
    LOST (a local job whose launcher ended without recording how the job ended)."""

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
    healing: tuple[str, ...] = ()
    """Each re-plan of a job that heals itself (training.heal), oldest first: "OOM at step 412
    with cp 4, checkpointing none; resumed at step 400 with cp 8, checkpointing selective"."""

    @property
    def terminal(self) -> bool:
        """Whether the job is over (its state never changes again)."""
        return self.state in TERMINAL


def describe_layout(spec: dict) -> str:
    """The layout of a job from its recorded spec (JSON), for an OOM report."""
    p, t = spec.get("parallel", {}), spec.get("training", {})
    return (
        f"model {spec.get('model', {}).get('preset') or 'custom'}, seq_len "
        f"{t.get('seq_len')}, cp {p.get('cp')} ({p.get('cp_algorithm')}, "
        f"{p.get('cp_sharding', p.get('layout'))}), activation_checkpointing "
        f"{t.get('activation_checkpointing')}, ZeRO-{t.get('zero_stage')}"
    )


@dataclass(frozen=True)
class BackendOptions:
    """Settings of one backend given on the command line; a backend takes only its own."""

    target: ClassVar[str] = ""
    flags: ClassVar[str] = ""
    """The command-line flags that set these options (for the error naming them)."""


@dataclass(frozen=True)
class KubernetesOptions(BackendOptions):
    """How to reach the cluster, and whether to submit for real."""

    target: ClassVar[str] = "kubernetes"
    flags: ClassVar[str] = "--context and --dry-run=server"
    context: str | None = None
    """The kubeconfig context (default: the current one)."""
    kubeconfig: str | None = None
    """The kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)."""
    server_dry_run: bool = False
    """Have the API server validate and admit the objects, and store nothing."""


class OptionsError(ValueError):
    """Options given to a backend that does not take them (another target's)."""


class Refused(RuntimeError):
    """The scheduler refused one job of a sweep; the sweep's other jobs still go."""


@dataclass(frozen=True)
class SweepJobs:
    """What scheduling one dry run of a sweep made: the record id of each of its specs, and a
    line for the user when the backend has one (a job array's id)."""

    job_ids: list[str]
    note: str | None = None


class Backend(ABC):
    """One scheduler (or the local machine), for the whole life of a job."""

    name: ClassVar[str]
    runs_here: ClassVar[bool] = False
    """Whether `schedule` runs the job in the foreground until it ends (this machine)."""
    shares_filesystem: ClassVar[bool] = True
    """Whether a job's files are the submitter's (the local machine's, a cluster's shared
    filesystem), so a job can write its result where the submitter reads it; else the result
    comes back through the job's log."""
    artifact_mode: ClassVar[int] = 0o644
    """The file mode `render --output` writes this backend's artifacts with (a batch script is
    run as a program, so the Slurm backend's is executable)."""

    @classmethod
    def with_options(cls, options: BackendOptions) -> Backend:
        """This backend with options from the command line; OptionsError unless they are its
        own (by default a backend takes none)."""
        raise OptionsError(
            f"{options.flags} are for cluster.target {options.target}, not {cls.name}"
        )

    def scheduler_name(self, record: JobRecord) -> str:
        """Whose word a status's `scheduler_state` is ("Slurm", "PyTorchJob"), for `status`
        to print beside it; by default the backend's name."""
        return self.name

    # -- submitting -----------------------------------------------------------------------------
    @abstractmethod
    def dryrun(self, spec: JobSpec, entry: JobEntry = TRAINING) -> DryRun:
        """Everything submitting `spec` would do, as data (nothing is written or started);
        `entry` is what the job runs."""

    @abstractmethod
    def submit(self, dryrun: DryRun) -> JobRecord:
        """Start or submit the job and record it; returns its record (a job on the local
        machine has ended by then)."""

    @abstractmethod
    def schedule(self, dryrun: DryRun) -> int:
        """Run or submit; returns the exit status for the `submit` command."""

    def result(self, record: JobRecord) -> Any:
        """What a job that hands a result back (the calibration: its profile) returned, as
        JSON data: by default the last result line of its log (contract.rundir.RESULT_LINE).
        ValueError when there is none or it is not JSON; RuntimeError when the log cannot be
        read."""
        import json

        printed = [
            line.split(RESULT_LINE, 1)[1] for line in self.read_log(record) if RESULT_LINE in line
        ]
        if not printed:
            raise ValueError("its log has no result line")
        try:
            return json.loads(printed[-1])
        except ValueError as exc:
            raise ValueError(f"its result line is not JSON ({exc})") from None

    # -- a sweep --------------------------------------------------------------------------------
    def sweep_groups(self, specs: list[JobSpec]) -> list[list[int]]:
        """The sweep's specs (by index) that go as one submission; by default each alone."""
        return [[index] for index in range(len(specs))]

    def sweep_dryrun(self, sweep_id: str, name: str, specs: list[JobSpec]) -> DryRun:
        """The dry run of one group of a sweep (`name`: the group's, for backends that submit
        a group as one job); by default the one spec's own."""
        return self.dryrun(specs[0])

    def schedule_sweep(self, dryrun: DryRun, specs: list[JobSpec]) -> SweepJobs:
        """Schedule one group of a sweep; Refused when the scheduler refused it alone (the
        sweep goes on), any other RuntimeError ends the sweep."""
        try:
            self.schedule(dryrun)
        except RuntimeError as exc:
            raise Refused(str(exc)) from None
        return SweepJobs([dryrun.job_id])

    # -- an existing job ------------------------------------------------------------------------
    @abstractmethod
    def status(self, record: JobRecord) -> Status:
        """Where the job stands; KeyError when the scheduler no longer knows it, RuntimeError
        when the scheduler cannot be asked."""

    @abstractmethod
    def read_log(self, record: JobRecord, rank: int | None = None) -> list[str]:
        """The job's log so far (every rank's lines, or one rank's, unprefixed)."""

    @abstractmethod
    def follow_log(self, record: JobRecord, rank: int | None = None) -> Iterator[str]:
        """The job's log lines as they are written, until the job is over."""

    @abstractmethod
    def cancel(self, record: JobRecord) -> None:
        """Cancel the job; RuntimeError when that cannot be done."""

    @abstractmethod
    def explain(self, record: JobRecord, status: Status) -> list[str]:
        """What a user needs next to a failed state (the failing rank's last lines, the OOM's
        layout); nothing for any other state."""

    def reported_progress(self, record: JobRecord) -> dict[str, Any] | None:
        """The job's last step as its scheduler holds it, where the job reports there (a
        TrainJob's trainerStatus), in the keys of a metrics.jsonl line; None by default: the
        run's own files say it."""
        return None

    def wait(self, record: JobRecord, timeout: float | None, poll: float) -> Status:
        """The job's status once it is final, asked every `poll` seconds; the last one seen
        (not final) once `timeout` seconds have passed. KeyError and RuntimeError as status."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.status(record)
            if state.terminal or (deadline is not None and time.monotonic() > deadline):
                return state
            time.sleep(poll)
