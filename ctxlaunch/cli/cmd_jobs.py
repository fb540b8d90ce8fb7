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
    load,
    out,
    print_warnings,
)
from ctxlaunch.cli.extras import require
from ctxlaunch.cli.tables import jobs_table, status_line, step_time_provenance
from ctxlaunch.contract import exitcodes

if TYPE_CHECKING:
    from ctxlaunch.launch.backends.base import Backend, DryRun
    from ctxlaunch.planning.plan import PlanReport


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
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Machine-readable output: every file's text by its path (writes nothing).",
        ),
    ] = False,
) -> None:
    """Render a Slurm batch script or a Kubeflow PyTorchJob/TrainJob manifest.

    In scrape mode the PodMonitor goes to monitoring/<name>-podmonitor.yaml under --output, out
    of the way of a plain `kubectl apply -f DIR` on a cluster without the Prometheus Operator;
    --monitoring adds the PrometheusRule and the dashboard's ConfigMap there."""
    from ctxlaunch import api
    from ctxlaunch.contract.fsutil import WriteFailed, write_files_whole
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.launch.render import TEMPLATES

    if target is not None and target not in TEMPLATES:
        fail(f"--target: {target!r} is not a target to render; use slurm or kubernetes")
    job = load(spec, set_, **({"cluster.target": target} if target else {}))
    try:
        rendered = api.render(job, monitoring=monitoring)
    except api.ApiError as exc:
        fail(str(exc))
    print_warnings(job)
    files, main_name, kind = rendered.files, rendered.main, rendered.target
    if as_json:
        out.print_json(json.dumps({"target": kind, "main": main_name, "files": files}))
        return
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
    from ctxlaunch import api
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
    try:
        backend = api.backend_for(job, context=context, server_dry_run=server_dry_run)
    except api.ApiError as exc:
        fail(str(exc))
    if backend.runs_here and not dry_run:
        require("submit", "torch")  # the job's ranks are this machine's processes
    dryrun = backend.dryrun(job)
    if dry_run:
        _say_prediction(report)
        if as_json:
            out.print_json(json.dumps(dryrun_dict(dryrun)))
        else:
            sys.stdout.write(dryrun.describe())
        return
    if as_json:
        if server_dry_run:
            fail("--json: --dry-run=server submits nothing to report; leave out --json")
        _submit_json(backend, dryrun, report)
    # Before a job that runs here; after a remote submission, so that a refusal stays one line.
    if backend.runs_here:
        _say_prediction(report)
    try:
        code = backend.schedule(dryrun)
    except RuntimeError as exc:  # the scheduler refused the job: nothing was submitted
        fail(str(exc))
    if not backend.runs_here and code == 0:
        _say_prediction(report)
    raise typer.Exit(code)


def _say_prediction(report: PlanReport | None) -> None:
    """The job's predicted step and run on stderr, with where the step's constants come from:
    whether the figure holds here, and how to calibrate where it does not."""
    from ctxlaunch.perf.accounting import duration

    step_time = report.step_time if report is not None else None
    if step_time is not None:
        run = report.accounting if report is not None else None
        whole = f", the run {duration(run.seconds.value)}" if run is not None else ""
        err.print(
            f"ctxlaunch: predicted step {step_time['step_seconds']:.3g} s{whole}; "
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


def _submit_json(backend: Backend, dryrun: DryRun, report: PlanReport | None = None) -> NoReturn:
    """`submit --json`: submit (a local job: run it, its output on stderr), print the record
    as JSON and exit with the status `submit` exits with."""
    import contextlib

    if backend.runs_here:
        _say_prediction(report)
    with contextlib.redirect_stdout(sys.stderr):  # a local job streams rank 0's lines
        try:
            record = backend.submit(dryrun)
        except RuntimeError as exc:  # the scheduler refused the job: nothing was submitted
            fail(str(exc))
    if not backend.runs_here:
        _say_prediction(report)
    answer: dict[str, Any] = {
        "id": record.id,
        "backend_id": record.backend_id,
        "name": record.name,
        "target": record.target,
    }
    code = exitcodes.OK
    if "exit_status" in record.extra:  # a local job has ended by now
        code = int(record.extra["exit_status"])
        answer["exit_status"] = code
    out.print_json(json.dumps(answer))
    raise typer.Exit(code)


AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def status(job: JobArg, as_json: AsJson = False) -> None:
    """Where a submitted job stands, and its run measured against its plan.

    States come from the scheduler; for a failure the failing rank's last lines, for an OOM
    the layout that caused it; progress, time left, and the step time, peak memory, MFU and
    tokens/s measured against predicted, with the difference in per cent."""
    from ctxlaunch import api

    try:
        found = api.status(job)
    except (api.JobNotFound, api.ApiError) as exc:
        fail(str(exc))
    except api.SchedulerError as exc:  # the scheduler cannot be asked
        fail(str(exc), code=exitcodes.FAILED)
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
        return
    _print_status(found)


def _print_status(found: Any) -> None:
    """A job's state line, its story, and its run against its plan."""
    out.print(status_line(found.record, found.status, found.scheduler), markup=False)
    for line in found.detail + found.measured.lines():
        out.print(f"  {line}", markup=False)


def logs(
    job: JobArg,
    follow_: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")
    ] = False,
    rank: Annotated[int | None, typer.Option("--rank", help="Only this rank's lines.")] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help='Machine-readable output: one JSON object per line ({"line": ...}), as the '
            "lines come.",
        ),
    ] = False,
) -> None:
    """Print a job's log (every rank's lines, labelled), or one rank's."""
    from ctxlaunch import api

    try:
        lines = api.logs(job, rank, follow_)
        for line in lines:
            if as_json:
                line = json.dumps({"line": line.rstrip("\n")}) + "\n"
            sys.stdout.write(line)
            sys.stdout.flush()
    except (api.JobNotFound, api.ApiError) as exc:
        fail(str(exc))
    except api.SchedulerError as exc:  # e.g. a Kubernetes job without pods yet
        fail(str(exc), code=exitcodes.FAILED)


def cancel(job: JobArg, as_json: AsJson = False) -> None:
    """Cancel a submitted job."""
    from ctxlaunch import api

    try:
        record = api.cancel(job)
    except (api.JobNotFound, api.ApiError) as exc:
        fail(str(exc))
    except api.SchedulerError as exc:
        fail(str(exc), code=exitcodes.FAILED)
    if as_json:
        out.print_json(
            json.dumps({"id": record.id, "backend_id": record.backend_id, "cancelled": True})
        )
        return
    err.print(f"cancelled {record.backend_id or record.id}")


def wait(
    job: JobArg,
    timeout: Annotated[
        float | None, typer.Option(help="Give up after this many seconds (exit 1).")
    ] = None,
    poll: Annotated[float, typer.Option(help="Seconds between checks.")] = 2.0,
    as_json: AsJson = False,
) -> None:
    """Wait until a job ends; exit 0 if it completed, 86 on an OOM, 1 otherwise."""
    from ctxlaunch import api
    from ctxlaunch.launch.backends.base import WAIT_EXIT

    try:
        found = api.wait(job, timeout, poll)
    except (api.JobNotFound, api.ApiError) as exc:
        fail(str(exc))
    except api.SchedulerError as exc:
        fail(str(exc), code=exitcodes.FAILED)
    state = found.status
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
    else:
        out.print(status_line(found.record, state, found.scheduler), markup=False)
    if not state.terminal:
        fail(f"still {state.state} after {timeout:g} s", code=exitcodes.FAILED)
    if not as_json:
        for line in found.detail + found.measured.lines():
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
