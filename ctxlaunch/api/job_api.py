"""A job's life: render it, submit it (or see what would be submitted), ask where it stands and
how it measures against its plan, wait for it, read its log, cancel it, and report on it (one
job, or a sweep's)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from ctxlaunch.api.errors import ApiError, JobNotFound, SchedulerError
from ctxlaunch.api.spec_api import SpecLike, load_spec

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.launch.backends.base import Backend, DryRun, Status
    from ctxlaunch.launch.jobstore import JobRecord
    from ctxlaunch.launch.measured import Measured
    from ctxlaunch.launch.report import SweepReport
    from ctxlaunch.planning.plan import PlanReport


@dataclass(frozen=True)
class Rendered:
    """What `render` writes: each file's text by its path under the output directory."""

    spec: JobSpec
    target: str
    main: str
    """The main artifact's name (the batch script, the job's manifest)."""
    files: dict[str, str]
    warnings: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.files[self.main]


def render(
    spec: SpecLike,
    overrides: Iterable[str] = (),
    *,
    target: str | None = None,
    monitoring: bool = False,
) -> Rendered:
    """The Slurm batch script or the Kubernetes manifests of a spec (its cluster.target, or
    `target`); nothing is written. ApiError for a target with nothing to render."""
    from ctxlaunch.launch.monitoring import MonitoringError, MonitoringOptions
    from ctxlaunch.launch.render import TEMPLATES, artifact_name, render_files

    if target is not None and target not in TEMPLATES:
        raise ApiError(f"--target: {target!r} is not a target to render; use slurm or kubernetes")
    job = load_spec(spec, overrides, **({"cluster.target": target} if target else {}))
    kind = next((known for known in TEMPLATES if known == job.cluster.target), None)
    if kind is None:
        raise ApiError(
            f"cluster.target is {job.cluster.target!r}: a local job has nothing to render "
            "(`ctxlaunch submit` runs it); give --target slurm or kubernetes"
        )
    try:
        files = render_files(job, kind, monitoring=MonitoringOptions() if monitoring else None)
    except MonitoringError as exc:
        raise ApiError(str(exc)) from None
    return Rendered(job, kind, artifact_name(job, kind), files, job.warnings())


@dataclass(frozen=True)
class Submitted:
    """A submission: its dry run (the exact command and bytes), and unless it was a dry run the
    job's record (a job on this machine has ended by then: its exit status is set)."""

    dry_run: DryRun
    plan: PlanReport
    record: JobRecord | None = None
    exit_status: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target": self.dry_run.target,
            "name": self.dry_run.spec.name,
            "prediction": self.plan.step_time,
            "accounting": self.plan.accounting.to_dict() if self.plan.accounting else None,
        }
        if self.record is not None:
            out.update(id=self.record.id, backend_id=self.record.backend_id)
        if self.exit_status is not None:
            out["exit_status"] = self.exit_status
        return out


def backend_for(
    job: JobSpec, *, context: str | None = None, server_dry_run: bool = False
) -> Backend:
    """The backend of `job`'s target with the command line's options; ApiError for options of
    another target."""
    from ctxlaunch.launch.backends import KubernetesOptions, OptionsError, get_backend

    options = (
        KubernetesOptions(context=context, server_dry_run=server_dry_run)
        if context or server_dry_run
        else None
    )
    try:
        return get_backend(job.cluster.target, options)
    except (NotImplementedError, OptionsError) as exc:
        raise ApiError(str(exc)) from None


def submit(
    spec: SpecLike,
    overrides: Iterable[str] = (),
    *,
    force: bool = False,
    dry_run: bool = False,
    context: str | None = None,
    output: IO[str] | None = None,
) -> Submitted:
    """Submit a spec to its target (a local job runs here to its end), or with `dry_run` only
    say what would be submitted. A job predicted not to fit is refused (ApiError) unless
    `force`. What the job and the backend print goes to `output` (default: nowhere)."""
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.planning.plan import plan_job

    job = load_spec(spec, overrides)
    report = plan_job(job, machine_for(job))
    if not report.fits and not force:
        raise ApiError(
            f"{job.name} is predicted not to fit: {report.verdict()}. Change the spec, or "
            "submit with force to submit anyway."
        )
    backend = backend_for(job, context=context)
    plan = backend.dryrun(job)
    if dry_run:
        return Submitted(plan, report)
    sink = output if output is not None else io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            record = backend.submit(plan)
        except RuntimeError as exc:  # the scheduler refused: nothing was submitted
            raise SchedulerError(str(exc)) from None
    code = record.extra.get("exit_status")
    return Submitted(plan, report, record, int(code) if code is not None else None)


def find(job: str) -> tuple[JobRecord, Backend]:
    """A submitted job's record and backend, by ctxlaunch's id or the scheduler's."""
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends import get_backend

    try:
        record = jobstore.find(job)
    except KeyError:
        known = ", ".join(r.backend_id or r.id for r in jobstore.all_records()[-5:])
        raise JobNotFound(
            f"no job {job!r} in {jobstore.jobs_root()}" + (f" (recent: {known})" if known else "")
        ) from None
    except ValueError as exc:  # a reference no job can have, or a damaged record
        raise ApiError(str(exc)) from None
    try:
        return record, get_backend(record.target)
    except NotImplementedError:
        raise ApiError(
            f"job {record.id}: its record names the target {record.target[:40]!r}, not one of ours"
        ) from None


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands: its state, what to know about a failure, and its run measured against
    its prediction (with its progress and time left)."""

    record: JobRecord
    status: Status
    scheduler: str
    """Whose word `status.scheduler_state` is (Slurm, PyTorchJob, ...)."""
    detail: list[str]
    measured: Measured

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        r = self.record
        return {
            "id": r.id,
            "backend_id": r.backend_id,
            "name": r.name,
            "target": r.target,
            **dataclasses.asdict(self.status),
            "detail": self.detail,
            "measured": self.measured.to_dict(),
        }


def _described(record: JobRecord, backend: Backend, state: Status) -> JobStatus:
    from ctxlaunch.launch.measured import measured_against_predicted

    try:
        detail = backend.explain(record, state)
    except KeyError:
        raise JobNotFound(f"the scheduler no longer knows job {record.backend_id}") from None
    except RuntimeError as exc:
        raise SchedulerError(str(exc)) from None
    return JobStatus(
        record,
        state,
        backend.scheduler_name(record),
        detail,
        measured_against_predicted(record, backend, state),
    )


def status(job: str) -> JobStatus:
    """Where job `job` stands, and its run measured against its plan."""
    record, backend = find(job)
    try:
        state = backend.status(record)
    except KeyError:
        raise JobNotFound(f"the scheduler no longer knows job {record.backend_id}") from None
    except RuntimeError as exc:  # the scheduler cannot be asked
        raise SchedulerError(str(exc)) from None
    return _described(record, backend, state)


def wait(job: str, timeout: float | None = None, poll: float = 2.0) -> JobStatus:
    """Job `job`'s status once it has ended, or the last one seen after `timeout` seconds
    (its `status.terminal` then False)."""
    record, backend = find(job)
    try:
        state = backend.wait(record, timeout, poll)
    except KeyError:
        raise JobNotFound(f"the scheduler no longer knows job {record.backend_id}") from None
    except RuntimeError as exc:
        raise SchedulerError(str(exc)) from None
    return _described(record, backend, state)


def cancel(job: str) -> JobRecord:
    """Cancel job `job`; its record. SchedulerError where it cannot be cancelled."""
    record, backend = find(job)
    try:
        backend.cancel(record)
    except RuntimeError as exc:
        raise SchedulerError(str(exc)) from None
    return record


def logs(job: str, rank: int | None = None, follow: bool = False) -> Iterator[str]:
    """Job `job`'s log lines (every rank's, labelled, or one rank's); with `follow`, as they
    are written until the job ends. ApiError for a rank the job does not have."""
    from ctxlaunch.launch.jobstore import recorded_ranks

    record, backend = find(job)
    ranks = recorded_ranks(record)
    if rank is not None and (rank < 0 or (ranks is not None and rank >= ranks)):
        known = f"ranks 0 to {ranks - 1}" if ranks and ranks > 1 else "rank 0 only"
        raise ApiError(f"--rank {rank}: job {record.backend_id or record.id} has {known}")
    return _lines(record, backend, rank, follow)


def _lines(record: JobRecord, backend: Backend, rank: int | None, follow: bool) -> Iterator[str]:
    try:
        yield from backend.follow_log(record, rank) if follow else backend.read_log(record, rank)
    except RuntimeError as exc:  # e.g. a Kubernetes job without pods yet
        raise SchedulerError(str(exc)) from None


def report(reference: str) -> SweepReport:
    """A sweep's results (by its id) or one job's (by its id or the scheduler's), measured
    against predicted, one row per job."""
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.report import build_report, job_sweep
    from ctxlaunch.perf.machine import load_calibration

    try:
        data = jobstore.load_sweep(reference)
    except KeyError:
        try:
            record = jobstore.find(reference)
        except KeyError:
            raise JobNotFound(
                f"no sweep or job {reference!r} in {jobstore.sweeps_root()} or "
                f"{jobstore.jobs_root()}"
            ) from None
        except ValueError as exc:  # a reference no job can have, or a damaged record
            raise ApiError(str(exc)) from None
        data = job_sweep(record)
    except ValueError as exc:  # a reference no sweep can have, or a damaged record
        raise ApiError(str(exc)) from None
    return build_report(data, load_calibration())
