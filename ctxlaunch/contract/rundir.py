"""Where the launcher and the job meet: the entry points a rendered job starts, the variables
that carry the spec and the run directory, the rendezvous port rule, and the per-rank exit
files. `launch` writes these into scripts and manifests; `runtime` reads them inside the job.
Neither imports the other, so everything both must agree on is defined here, once."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ctxlaunch.contract import exitcodes

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec

TRAINER_MODULE = "ctxlaunch.runtime.trainer"
"""`python -m ctxlaunch.runtime.trainer`: one rank of the trainer (what torchrun and srun
start)."""
EVAL_MODULE = "ctxlaunch.runtime.evaluation.eval_main"
"""`python -m ctxlaunch.runtime.evaluation.eval_main SPEC --out RESULT`: one rank of `ctxlaunch eval`
(torchrun starts it), which evaluates a checkpoint and writes the result (JSON) from rank 0."""
POD_MODULE = "ctxlaunch.runtime.podentry"
"""A PyTorchJob pod's command: torchrun on the trainer, exiting with a status the training
operator's ExitCode restart policy reads right (see ctxlaunch.runtime.podentry)."""

CALIBRATE_MODULE = "ctxlaunch.runtime.calibration.job"
"""`python -m ctxlaunch.runtime.calibration.job SPEC [--out PROFILE]`: the calibration job,
one process per node, that measures the node and prints (and writes) its machine profile."""
CALIBRATE_FUNCTION = "calibrate_node"
"""The function of CALIBRATE_MODULE a function job (submitit) calls: `calibrate_node(spec_json,
out)` returns the profile as JSON-able data."""
RESULT_LINE = "ctxlaunch result: "
"""How the log line that carries a job's result (JSON) begins: a job whose filesystem is not the
submitter's (a pod) hands its result back through its log."""


@dataclass(frozen=True)
class JobEntry:
    """What a job runs on each node. The launch request turns it into the command line of the
    batch script, the pod or the local launcher; a function job (`function` set) goes to Slurm
    through submitit, which calls `module.function(spec_json, result_file)` and hands back what
    it returns."""

    name: str
    """What the job is, in words ("training", "calibration")."""
    module: str
    """The module `python -m` starts; it takes the spec file and `--run-dir DIR` first."""
    args: tuple[str, ...] = ()
    """Further arguments after the spec and the run directory."""
    ranks_per_node: int | None = None
    """Processes per node; None: one per GPU (cluster.gpus_per_node)."""
    function: str | None = None
    """For a job whose result comes back: the function of `module` that returns it."""
    result_file: str | None = None
    """Where the job writes its result besides printing it (a path on a shared filesystem)."""


TRAINING = JobEntry(name="training", module=TRAINER_MODULE)
"""The trainer, one rank per GPU."""


def calibration_entry(out: str | None) -> JobEntry:
    """The calibration job: one process per node; it writes its profile to `out` when the
    submitter shares the job's filesystem (None: the result comes back through the log or the
    function's return value only)."""
    return JobEntry(
        name="calibration",
        module=CALIBRATE_MODULE,
        args=("--out", out) if out else (),
        ranks_per_node=1,
        function=CALIBRATE_FUNCTION,
        result_file=out,
    )


SPEC_ENV = "CTXLAUNCH_SPEC_JSON"
"""The resolved spec travels to every rank in this variable (Slurm) or as a mounted file."""
RUN_DIR_ENV = "CTXLAUNCH_RUN_DIR"
"""The run directory: logs, metrics, exit files and the job's events."""
JOB_ID_ENV = "CTXLAUNCH_JOB_ID"
"""ctxlaunch's id of the job, in every rank's environment (telemetry labels, sweeps)."""
DEFAULT_RUNS_DIR = "runs"
"""Without a run directory given, a job keeps its run in runs/<job name> (relative to where it
starts)."""
TRAINJOB_ENV = "CTXLAUNCH_TRAINJOB"
"""In a TrainJob's pods that report progress (cluster.kubernetes.trainer_status): the TrainJob's
namespace/name, whose status.trainerStatus rank 0 writes."""
TRAINJOB_TOKEN_DIR = "/var/run/secrets/ctxlaunch/trainjob-status"
"""Where a TrainJob's trainer container finds the token (`token`) and the cluster's CA
(`ca.crt`) it writes the TrainJob's status with: a projected volume mounted in that container
only, the pod's own service-account token left unmounted."""
HOME_ENV = "CTXLAUNCH_HOME"
"""Where job records and the CPU calibration live (default ~/.ctxlaunch)."""

SLURM_BASE_PORT = 20000
SLURM_PORT_SPAN = 20000
"""Slurm jobs rendezvous on SLURM_BASE_PORT + job id % SLURM_PORT_SPAN, so two jobs sharing a
node (small allocations, test clusters) never collide."""


def slurm_rendezvous_port(job_id: int) -> int:
    """The rendezvous port of Slurm job `job_id` (what the batch script exports)."""
    return SLURM_BASE_PORT + job_id % SLURM_PORT_SPAN


def slurm_rendezvous_port_shell(job_id_var: str = "SLURM_JOB_ID") -> str:
    """The same rule as a shell arithmetic expansion, for the batch script."""
    return f"$(( {SLURM_BASE_PORT} + {job_id_var} % {SLURM_PORT_SPAN} ))"


def default_run_dir(job_name: str) -> Path:
    """The run directory of a job started with neither --run-dir nor $CTXLAUNCH_RUN_DIR."""
    return Path(DEFAULT_RUNS_DIR) / job_name


def home() -> Path:
    """ctxlaunch's own directory on this machine: $CTXLAUNCH_HOME, default ~/.ctxlaunch."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".ctxlaunch")


def spec_json(spec: JobSpec) -> str:
    """The resolved spec (presets expanded, defaults filled) as compact, stable JSON."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def cpu_threads_per_rank(ranks_per_node: int) -> int:
    """CPU ranks share the node's cores evenly (torchrun would give each one thread, srun
    leaves each all of them)."""
    return max(1, (os.cpu_count() or 1) // ranks_per_node)


EXIT_DIR = "exit"
"""Each rank writes its exit status to <run dir>/exit/rank-<r>."""


def exit_file(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` leaves its exit status."""
    return run_dir / EXIT_DIR / f"rank-{rank}"


def write_exit_code(run_dir: Path, rank: int, code: int) -> None:
    """Leave this rank's exit status for the launcher (the pod entry, the local backend)."""
    path = exit_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{code}\n")


def rank_exit_codes(run_dir: Path, count: int, first: int = 0) -> list[int | None]:
    """The exit statuses of ranks first .. first+count-1 (None: the rank left none)."""
    codes: list[int | None] = []
    for rank in range(first, first + count):
        try:
            codes.append(int(exit_file(run_dir, rank).read_text().strip()))
        except (OSError, ValueError):
            codes.append(None)
    return codes


def combine_exit_codes(codes: Iterable[int | None]) -> int:
    """One status for a job from its ranks' (None: the rank left no status, e.g. killed).
    An OOM anywhere is the job's story; then a failure; a requeue request only when every
    other rank finished cleanly."""
    codes = list(codes)
    if any(c == exitcodes.OOM for c in codes):
        return exitcodes.OOM
    if any(
        c is None or c not in (exitcodes.OK, exitcodes.PREEMPTED, exitcodes.BAD_INPUT)
        for c in codes
    ):
        return exitcodes.FAILED
    if any(c == exitcodes.BAD_INPUT for c in codes):
        return exitcodes.BAD_INPUT
    if any(c == exitcodes.PREEMPTED for c in codes):
        return exitcodes.PREEMPTED
    return exitcodes.OK
