"""`render`, `submit`, `status`, `logs`, `cancel`, `wait` and `list`: one job's life."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from ctxlaunch.cli.common import (
    JobArg,
    SetOpt,
    SpecArg,
    err,
    fail,
    find_job,
    load,
    out,
    print_warnings,
)
from ctxlaunch.cli.extras import require
from ctxlaunch.cli.tables import jobs_table, status_line, step_time_provenance
from ctxlaunch.contract import exitcodes

if TYPE_CHECKING:
    from ctxlaunch.launch.backends.base import Backend, DryRun


def render(
    spec: SpecArg,
    target: Annotated[
        str | None,
        typer.Option(
            "--target", "-t", help="slurm or kubernetes; default: the spec's cluster.target."
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Directory to write <name>.sbatch / <name>.yaml into "
            "(atomically); default: print to stdout.",
        ),
    ] = None,
    monitoring: Annotated[
        bool,
        typer.Option(
            "--monitoring",
            help="Kubernetes: also write the job's PrometheusRule (the alert rules, "
            "monitoring/<name>-rules.yaml) and the Grafana dashboard's ConfigMap for Grafana's "
            "sidecar (monitoring/ctxlaunch-dashboard.yaml); needs telemetry.prometheus scrape "
            "or push.",
        ),
    ] = False,
    set_: SetOpt = None,
) -> None:
    """Render a Slurm batch script or a Kubeflow PyTorchJob/TrainJob manifest.

    In scrape mode the PodMonitor goes to monitoring/<name>-podmonitor.yaml under --output, out
    of the way of a plain `kubectl apply -f DIR` on a cluster without the Prometheus Operator;
    --monitoring adds the PrometheusRule and the dashboard's ConfigMap there."""
    from ctxlaunch.contract.fsutil import WriteFailed, write_files_whole
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.launch.monitoring import MonitoringError, MonitoringOptions
    from ctxlaunch.launch.render import TEMPLATES, artifact_name, render_files

    if target is not None and target not in TEMPLATES:
        fail(f"--target: {target!r} is not a target to render; use slurm or kubernetes")
    job = load(spec, set_, **({"cluster.target": target} if target else {}))
    # The render targets by name, typed: the spec's target must be one of them.
    kind = next((known for known in TEMPLATES if known == job.cluster.target), None)
    if kind is None:
        fail(
            f"cluster.target is {job.cluster.target!r}: a local job has nothing to render "
            "(`ctxlaunch submit` runs it); give --target slurm or kubernetes"
        )
    print_warnings(job)
    try:
        files = render_files(job, kind, monitoring=MonitoringOptions() if monitoring else None)
    except MonitoringError as exc:
        fail(str(exc))
    main_name = artifact_name(job, kind)
    if output is None:
        sys.stdout.write(files[main_name])
        for extra in sorted(set(files) - {main_name}):
            object_kind = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in files[extra].splitlines()
                    if line.startswith("kind:")
                ),
                "a further object",
            )
            err.print(f"note: {extra} (the {object_kind}) is written only with --output DIR")
        return
    if output.exists() and not output.is_dir():
        fail(f"--output: {output} exists and is not a directory")
    mode = get_backend(kind).artifact_mode
    try:
        written = write_files_whole(
            {output / name: (text.encode("utf-8"), mode) for name, text in files.items()}
        )
    except WriteFailed as exc:
        fail(f"--output: {exc}; nothing was written")
    except KeyboardInterrupt:
        fail("--output: interrupted; nothing was written", exitcodes.FAILED)
    for path in written:
        err.print(f"wrote {path}")


def submit(
    spec: SpecArg,
    set_: SetOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the exact command and bytes that would be submitted "
            "(Kubernetes: --dry-run=server has the API server validate the objects and store "
            "nothing).",
        ),
    ] = False,
    server_dry_run: Annotated[bool, typer.Option("--dry-run-server", hidden=True)] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Submit even if the planner predicts the job will not fit."),
    ] = False,
    context: Annotated[
        str | None,
        typer.Option(
            "--context", help="Kubernetes: the kubeconfig context (default: the current one)."
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Machine-readable output: the job's ids and target (a local job's exit status; "
            "its own output goes to stderr), or with --dry-run what would be submitted.",
        ),
    ] = False,
) -> None:
    """Run or submit the job on its cluster.target (local by default, Slurm or Kubernetes).

    A job predicted not to fit is refused unless --force; --dry-run prints the exact command
    and the bytes that would be submitted."""
    from ctxlaunch.launch.backends import KubernetesOptions, OptionsError, get_backend
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.planning.plan import plan_job

    job = load(spec, set_)
    print_warnings(job)
    report = plan_job(job, machine_for(job))
    if not report.fits and not force:
        fail(
            f"{job.name} is predicted not to fit: {report.verdict()}. Change the spec (see "
            f"`ctxlaunch plan {spec}`), or pass --force to submit anyway."
        )
    options = (
        KubernetesOptions(context=context, server_dry_run=server_dry_run)
        if context or server_dry_run
        else None
    )
    try:
        backend = get_backend(job.cluster.target, options)
    except (NotImplementedError, OptionsError) as exc:
        fail(str(exc))
    if backend.runs_here and not dry_run:
        require("submit", "torch")  # the job's ranks are this machine's processes
    dryrun = backend.dryrun(job)
    if dry_run:
        _say_prediction(report.step_time)
        if as_json:
            out.print_json(json.dumps(dryrun_dict(dryrun)))
        else:
            sys.stdout.write(dryrun.describe())
        return
    if as_json:
        if server_dry_run:
            fail("--json: --dry-run=server submits nothing to report; leave out --json")
        _submit_json(backend, dryrun, report.step_time)
    # Before a job that runs here; after a remote submission, so that a refusal stays one line.
    if backend.runs_here:
        _say_prediction(report.step_time)
    try:
        code = backend.schedule(dryrun)
    except RuntimeError as exc:  # the scheduler refused the job: nothing was submitted
        fail(str(exc))
    if not backend.runs_here and code == 0:
        _say_prediction(report.step_time)
    raise typer.Exit(code)


def _say_prediction(step_time: dict[str, Any] | None) -> None:
    """The job's predicted step on stderr, with where its constants come from: whether the
    figure holds here, and how to calibrate where it does not."""
    if step_time is not None:
        err.print(
            f"ctxlaunch: predicted step {step_time['step_seconds']:.3g} s; "
            + step_time_provenance(step_time),
            markup=False,
        )


def dryrun_dict(dryrun: DryRun) -> dict[str, Any]:
    """`submit --dry-run --json`: what would be run and submitted."""
    return {
        "target": dryrun.target,
        "id": dryrun.job_id,
        "name": dryrun.spec.name,
        "command": dryrun.command,
        "env": dryrun.env,
        "artifact_name": dryrun.artifact_name,
        "artifact": dryrun.artifact,
        "extra_artifacts": dryrun.extra_artifacts,
    }


def _submit_json(
    backend: Backend, dryrun: DryRun, step_time: dict[str, Any] | None = None
) -> NoReturn:
    """`submit --json`: submit (a local job: run it, its output on stderr), print the record
    as JSON and exit with the status `submit` exits with."""
    import contextlib

    if backend.runs_here:
        _say_prediction(step_time)
    with contextlib.redirect_stdout(sys.stderr):  # a local job streams rank 0's lines
        try:
            record = backend.submit(dryrun)
        except RuntimeError as exc:  # the scheduler refused the job: nothing was submitted
            fail(str(exc))
    if not backend.runs_here:
        _say_prediction(step_time)
    report: dict[str, Any] = {
        "id": record.id,
        "backend_id": record.backend_id,
        "name": record.name,
        "target": record.target,
    }
    code = exitcodes.OK
    if "exit_status" in record.extra:  # a local job has ended by now
        code = int(record.extra["exit_status"])
        report["exit_status"] = code
    out.print_json(json.dumps(report))
    raise typer.Exit(code)


def status(
    job: JobArg,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Where a submitted job stands.

    States come from the scheduler; for a failure the failing rank's last lines, for an OOM
    the layout that caused it."""
    import dataclasses

    record, backend = find_job(job)
    try:
        state = backend.status(record)
        detail = backend.explain(record, state)
    except KeyError:
        fail(f"the scheduler no longer knows job {record.backend_id}")
    except RuntimeError as exc:  # the scheduler cannot be asked
        fail(str(exc), code=exitcodes.FAILED)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "id": record.id,
                    "backend_id": record.backend_id,
                    "name": record.name,
                    "target": record.target,
                    **dataclasses.asdict(state),
                    "detail": detail,
                }
            )
        )
        return
    out.print(status_line(record, state, backend.scheduler_name(record)), markup=False)
    for line in detail:
        out.print(f"  {line}", markup=False)


def logs(
    job: JobArg,
    follow_: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")
    ] = False,
    rank: Annotated[int | None, typer.Option("--rank", help="Only this rank's lines.")] = None,
) -> None:
    """Print a job's log (every rank's lines, labelled), or one rank's."""
    record, backend = find_job(job)
    try:
        lines = backend.follow_log(record, rank) if follow_ else backend.read_log(record, rank)
        for line in lines:
            sys.stdout.write(line)
            sys.stdout.flush()
    except RuntimeError as exc:  # e.g. a Kubernetes job without pods yet
        fail(str(exc), code=exitcodes.FAILED)


def cancel(job: JobArg) -> None:
    """Cancel a submitted job."""
    record, backend = find_job(job)
    try:
        backend.cancel(record)
    except RuntimeError as exc:
        fail(str(exc), code=exitcodes.FAILED)
    err.print(f"cancelled {record.backend_id or record.id}")


def wait(
    job: JobArg,
    timeout: Annotated[
        float | None, typer.Option(help="Give up after this many seconds (exit 1).")
    ] = None,
    poll: Annotated[float, typer.Option(help="Seconds between checks.")] = 2.0,
) -> None:
    """Wait until a job ends; exit 0 if it completed, 86 on an OOM, 1 otherwise."""
    from ctxlaunch.launch.backends.base import WAIT_EXIT

    record, backend = find_job(job)
    try:
        state = backend.wait(record, timeout, poll)
    except KeyError:
        fail(f"the scheduler no longer knows job {record.backend_id}")
    except RuntimeError as exc:
        fail(str(exc), code=exitcodes.FAILED)
    out.print(status_line(record, state, backend.scheduler_name(record)), markup=False)
    if not state.terminal:
        fail(f"still {state.state} after {timeout:g} s", code=exitcodes.FAILED)
    for line in backend.explain(record, state):
        out.print(f"  {line}", markup=False)
    raise typer.Exit(WAIT_EXIT.get(state.state, exitcodes.FAILED))


def list_jobs(
    limit: Annotated[int, typer.Option(help="Show the newest this many.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The jobs submitted from this machine, newest last, with their current state."""
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends import get_backend

    rows = []
    records, damaged = jobstore.scan_records()
    for problem in damaged:  # named, and skipped: the other jobs are still listed
        err.print(f"warning: {problem}; skipped", markup=False)
    for record in records[-limit:]:
        try:
            state = get_backend(record.target).status(record).state
        except (KeyError, RuntimeError, ValueError):  # NotImplementedError is a RuntimeError
            state = "UNKNOWN"
        rows.append((record, state))
    if as_json:
        listed = [
            {
                "id": record.id,
                "name": record.name,
                "target": record.target,
                "backend_id": record.backend_id,
                "state": state,
                "created": record.created,
            }
            for record, state in rows
        ]
        out.print_json(json.dumps(listed))
        return
    out.print(jobs_table(rows))
