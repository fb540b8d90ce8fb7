"""The `ctxlaunch` command: validate, plan, render, schema, submit, ...

Exit statuses: 0 success, 2 bad input (nothing written, nothing started), 1 a failed job or
backend error; see ctxlaunch.contract.exitcodes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from ctxlaunch import __version__
from ctxlaunch.cli.data import data as data_app
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.hardware import GiB
from ctxlaunch.contract.loader import SpecError, apply_overrides, read_spec_data, validate_spec
from ctxlaunch.contract.spec import JobSpec

app = typer.Typer(
    name="ctxlaunch",
    help="Plan, render, submit and run long-context (context-parallel) training jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False, soft_wrap=True)
if not out.is_terminal:
    out.width = 160  # tables piped to a file or a program should not wrap at 80 columns
err = Console(stderr=True, highlight=False, soft_wrap=True)
app.add_typer(data_app, name="data")

SpecArg = Annotated[Path, typer.Argument(help="Job spec (YAML).", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a field: path.to.field=value (YAML value). "
                 "Repeatable."),
]


def fail(message: str, code: int = exitcodes.BAD_INPUT) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", markup=True)
    raise typer.Exit(code)


def load(spec: Path, overrides: list[str] | None, **forced: object) -> JobSpec:
    """Read and validate a spec, or exit 2 listing every problem. `forced` sets fields the
    command itself decides (e.g. render --target sets cluster.target)."""
    try:
        data = apply_overrides(read_spec_data(spec), overrides or ())
        if forced:
            data = apply_overrides(data, [f"{k}={json.dumps(v)}" for k, v in forced.items()])
        return validate_spec(data, str(spec))
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None


def print_warnings(spec: JobSpec) -> None:
    for warning in spec.warnings():
        err.print(f"[yellow]warning:[/] {warning}", markup=True)


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", help="Print the version.")] = False
          ) -> None:
    if version:
        out.print(__version__)
        raise typer.Exit()


@app.command()
def validate(spec: SpecArg, set_: SetOpt = None) -> None:
    """Check a spec: every problem with its field path, the value, the rule and a fix."""
    job = load(spec, set_)
    print_warnings(job)
    c, p = job.cluster, job.parallel
    out.print(f"ok: {job.name}: {c.nodes} x {c.gpus_per_node} {c.gpu} "
              f"(tp {p.tp}, pp {p.pp}, cp {p.cp} {p.cp_algorithm}, ep {p.ep}, dp {job.dp}), "
              f"target {c.target}")


@app.command()
def plan(
    spec: SpecArg,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Predict per-GPU memory and FLOPs before submitting.

    Fit or not and by how much, the smallest CP degree that fits, the longest sequence at each
    CP degree, and model FLOPs in both MFU conventions."""
    from ctxlaunch.planning.advise import machine_for_advice
    from ctxlaunch.planning.plan import plan_job

    job = load(spec, set_)
    report = plan_job(job, machine_for_advice(job, None, job.cluster.gpus_per_node))
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    print_warnings(job)
    _print_plan(report)


def _gib(value: float) -> str:
    return f"{value / GiB:,.2f}"


def _print_plan(report) -> None:  # type: ignore[no-untyped-def]
    job, e = report.spec, report.estimate
    p, t = job.parallel, job.training
    out.print(f"[bold]{job.name}[/]: {job.model.preset or 'custom'} model, "
              f"seq_len {t.seq_len:,} x micro_batch {t.micro_batch}, {job.cluster.nodes} x "
              f"{job.cluster.gpus_per_node} {job.cluster.gpu}, tp {p.tp} pp {p.pp} cp {p.cp} "
              f"({p.cp_algorithm}, {p.layout}) dp {job.dp}, ZeRO-{t.zero_stage}, "
              f"checkpointing {t.activation_checkpointing}, {job.model.dtype}")
    table = Table(title="Per-GPU memory (busiest rank)", title_justify="left")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for name, value in e.parts():
        table.add_row(name.replace("_", " "), _gib(value))
    table.add_row("[bold]total[/]", f"[bold]{_gib(e.total)}[/]")
    table.add_row("capacity", _gib(e.capacity))
    table.add_row("headroom", _gib(e.headroom))
    out.print(table)
    colour = "green" if e.fits else "red"
    out.print(f"[bold {colour}]{report.verdict()}[/]")

    cps = Table(title="At other CP degrees (TP, PP, DP held)", title_justify="left")
    for column in ("cp", "GPUs", "nodes", "GiB/GPU", "fits", "longest seq that fits", "note"):
        cps.add_column(column, justify="left" if column == "note" else "right")
    for o in report.cp_options:
        note = "" if o.legal else (o.reason or "")
        cps.add_row(str(o.cp), str(o.gpus), str(o.nodes), _gib(o.estimate.total),
                    "yes" if o.fits else "no", f"{o.longest_seq_len:,}",
                    note[:90] + ("..." if len(note) > 90 else ""))
    out.print(cps)

    f = report.flops
    flops = Table(title="Model FLOPs (forward + backward)", title_justify="left")
    flops.add_column("convention")
    flops.add_column("per token", justify="right")
    flops.add_column("per step", justify="right")
    flops.add_column("per GPU per step", justify="right")
    for conv in ("full", "causal"):
        flops.add_row(f"{conv}: {f['conventions'][conv]}", f"{f['per_token'][conv]:.4g}",
                      f"{f['per_step'][conv]:.4g}", f"{f['per_gpu_per_step'][conv]:.4g}")
    out.print(flops)
    out.print(f"parameters: {f['params_total']:,} ({f['params_matmul']:,} in matmuls); "
              f"tokens per step: {f['tokens_per_step']:,}")
    st = report.step_time
    if st is not None:
        out.print(f"predicted step: {st['step_seconds']:.4g} s, "
                  f"{st['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, MFU "
                  f"{st['mfu']['full']:.1%} (full) / {st['mfu']['causal']:.1%} (causal); "
                  f"`ctxlaunch advise` ranks the other layouts")


@app.command()
def advise(
    spec: SpecArg,
    set_: SetOpt = None,
    top: Annotated[int, typer.Option("--top", help="Show the N fastest layouts.", min=1)] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    gpus: Annotated[int | None, typer.Option(
        "--gpus", help="Advise for this many GPUs instead of the spec's.", min=1)] = None,
    nodes: Annotated[int | None, typer.Option(
        "--nodes", help="Advise for this many nodes (of the spec's gpus_per_node).",
        min=1)] = None,
    fp8: Annotated[bool, typer.Option(
        "--fp8", help="Time the weight matmuls in FP8 (Transformer Engine recipes; the "
        "bundled trainer runs bf16/fp32).")] = False,
    write: Annotated[Path | None, typer.Option(
        "--write", help="Save the fastest layout as a spec to this file (atomically).")] = None,
) -> None:
    """Rank every legal layout that fits by predicted step time.

    TP within the NVLink domain, PP and virtual stages, CP degree and algorithm, ZeRO stage,
    activation checkpointing and micro-batch, each with predicted memory, step time,
    tokens/s/GPU and MFU in both conventions; the rejected ones grouped by reason."""
    from ctxlaunch.planning.advise import (
        advice_spec_text,
        load_for_advice,
        machine_for_advice,
        print_advice,
    )
    from ctxlaunch.planning.advise import advise as run_advice

    try:
        data, job, note = load_for_advice(spec, set_)
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    if gpus is not None and nodes is not None:
        fail("--gpus and --nodes: give one of them")
    per_node = job.cluster.gpus_per_node
    n_nodes = nodes
    if gpus is not None:
        if gpus < per_node:
            n_nodes, per_node = 1, gpus
        elif gpus % per_node:
            fail(f"--gpus {gpus}: not a whole number of nodes of {per_node} GPUs "
                 "(cluster.gpus_per_node)")
        else:
            n_nodes = gpus // per_node
    if n_nodes is not None and n_nodes > 1 and job.cluster.target == "local":
        fail(f"--nodes/--gpus: {n_nodes} nodes, but target local runs on one node; set "
             "cluster.target (e.g. --set cluster.target=slurm)")
    advice = run_advice(job, nodes=n_nodes, gpus_per_node=per_node,
                        machine=machine_for_advice(job, n_nodes, per_node),
                        matmul_precision="fp8" if fp8 else None)
    if note:
        advice.notes.insert(0, note)
    if write is not None:
        if advice.best is None:
            fail(f"--write {write}: no layout fits, nothing written")
        text = advice_spec_text(data, advice, str(spec))
        from ctxlaunch.contract.fsutil import atomic_write_text

        atomic_write_text(write, text)
        err.print(f"wrote {write}: {advice.best.describe()}")
    if as_json:
        out.print_json(json.dumps(advice.to_dict(top)))
        return
    print_advice(out, advice, top)


@app.command()
def calibrate(
    spec: Annotated[Path | None, typer.Argument(
        help="Measure attention at this spec's model shape and dtype (default: the tiny "
        "preset, fp32).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Measure this CPU for the step-time model: matmul (at the model's shapes) and attention
    throughput, memory bandwidth, the model's elementwise rate and fixed cost per micro-batch,
    gloo loopback bandwidth and latency. `advise` and `report` on `gpu: cpu` use
    them (saved in $CTXLAUNCH_HOME/cpu_calibration.json)."""
    import dataclasses

    from ctxlaunch.runtime.calibrate import measure, save_calibration

    model = None
    if spec is not None:
        model = load(spec, None).model
    try:
        calibration = measure(heads=model.heads if model else 4,
                              head_dim=model.head_dim if model else 32,
                              dtype=model.dtype if model else "fp32", model=model)
    except RuntimeError as exc:
        fail(str(exc), code=exitcodes.FAILED)
    path = save_calibration(calibration)
    if as_json:
        out.print_json(json.dumps(dataclasses.asdict(calibration)))
    else:
        c = calibration
        out.print(f"matmul {c.matmul_flops_per_second / 1e9:.1f} GFLOP/s, attention "
                  f"{c.attention_flops_per_second / 1e9:.1f} GFLOP/s, memory "
                  f"{c.memory_bytes_per_second / 1e9:.1f} GB/s, elementwise "
                  f"{c.elementwise_bytes_per_second / 1e9:.2f} GB/s, gloo loopback "
                  f"{c.link_bytes_per_second / 1e9:.2f} GB/s + {c.link_latency_seconds * 1e6:.0f}"
                  f" us, {c.microbatch_overhead_seconds * 1e3:.1f} ms fixed per micro-batch "
                  f"({c.cores} cores)")
        if c.one_thread:
            one = c.one_thread
            out.print(f"one thread: matmul {one['matmul'] / 1e9:.1f} GFLOP/s, attention "
                      f"{one['attention'] / 1e9:.1f} GFLOP/s, elementwise "
                      f"{one['elementwise'] / 1e9:.2f} GB/s")
    err.print(f"wrote {path}")


@app.command()
def render(
    spec: SpecArg,
    target: Annotated[str, typer.Option("--target", "-t", help="slurm or kubernetes.")],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Directory to write <name>.sbatch / <name>.yaml into "
        "(atomically); default: print to stdout.")] = None,
    set_: SetOpt = None,
) -> None:
    """Render a Slurm batch script or a Kubeflow PyTorchJob manifest.

    In scrape mode the PodMonitor goes to monitoring/<name>-podmonitor.yaml under --output, out
    of the way of a plain `kubectl apply -f DIR` on a cluster without the Prometheus Operator."""
    from ctxlaunch.contract.fsutil import atomic_write_text
    from ctxlaunch.launch.render import artifact_name, render_files

    if target not in ("slurm", "kubernetes"):
        fail(f"--target: {target!r} is not a target to render; use slurm or kubernetes")
    job = load(spec, set_, **{"cluster.target": target})
    print_warnings(job)
    files = render_files(job, target)  # type: ignore[arg-type]
    main_name = artifact_name(job, target)  # type: ignore[arg-type]
    if output is None:
        sys.stdout.write(files[main_name])
        for extra in set(files) - {main_name}:
            err.print(f"note: {extra} (the PodMonitor) is written only with --output DIR")
        return
    if output.exists() and not output.is_dir():
        fail(f"--output: {output} exists and is not a directory")
    for name, text in files.items():
        path = atomic_write_text(output / name, text,
                                 mode=0o755 if target == "slurm" else 0o644)
        err.print(f"wrote {path}")


@app.command()
def submit(
    spec: SpecArg,
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the exact command and bytes that would be submitted "
        "(Kubernetes: --dry-run=server has the API server validate the objects and store "
        "nothing).")] = False,
    server_dry_run: Annotated[bool, typer.Option("--dry-run-server", hidden=True)] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Submit even if the planner predicts the job will not fit.")] = False,
    context: Annotated[str | None, typer.Option(
        "--context", help="Kubernetes: the kubeconfig context (default: the current one).")
    ] = None,
) -> None:
    """Run or submit the job on its cluster.target (local by default, Slurm or Kubernetes).

    A job predicted not to fit is refused unless --force; --dry-run prints the exact command
    and the bytes that would be submitted."""
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.planning.plan import plan_job

    job = load(spec, set_)
    print_warnings(job)
    report = plan_job(job)
    if not report.fits and not force:
        fail(f"{job.name} is predicted not to fit: {report.verdict()}. Change the spec (see "
             f"`ctxlaunch plan {spec}`), or pass --force to submit anyway.")
    try:
        backend = get_backend(job.cluster.target)
    except NotImplementedError as exc:
        fail(str(exc))
    if (context or server_dry_run) and job.cluster.target != "kubernetes":
        fail(f"--context and --dry-run=server are for cluster.target kubernetes, not "
             f"{job.cluster.target}")
    if context:
        backend.context = context  # type: ignore[attr-defined]
    dryrun = backend.dryrun(job)
    if dry_run:
        sys.stdout.write(dryrun.describe())
        return
    try:
        if server_dry_run:
            code = backend.server_dryrun(dryrun)  # type: ignore[attr-defined]
        else:
            code = backend.schedule(dryrun)
    except RuntimeError as exc:  # the scheduler refused the job: nothing was submitted
        fail(str(exc))
    raise typer.Exit(code)


JobArg = Annotated[str, typer.Argument(help="ctxlaunch job id or the scheduler's job id.",
                                       show_default=False)]


def find_job(reference: str):  # type: ignore[no-untyped-def]
    """The record and backend of a submitted job, or exit 2 naming what is known."""
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends import get_backend

    try:
        record = jobstore.find(reference)
    except KeyError:
        known = ", ".join(r.backend_id or r.id for r in jobstore.all_records()[-5:])
        fail(f"no job {reference!r} in {jobstore.jobs_root()}"
             + (f" (recent: {known})" if known else ""))
    return record, get_backend(record.target)


_SCHEDULERS = {"slurm": "Slurm", "kubernetes": "PyTorchJob"}


def _status_line(record, status) -> str:  # type: ignore[no-untyped-def]
    parts = [f"{record.backend_id or record.id}: {status.state}"]
    if status.scheduler_state and status.scheduler_state != status.state:
        parts.append(f"({_SCHEDULERS.get(record.target, record.target)}: "
                     f"{status.scheduler_state})")
    if status.reason:
        parts.append(f"reason {status.reason}")
    if status.nodes:
        parts.append(f"on {status.nodes}")
    if status.exit_code:
        parts.append(f"exit {status.exit_code}")
    parts.append(f"restarts {status.restarts}")
    line = " ".join(parts) + f"  [{record.name}, {record.target}, {record.id}]"
    return line + (f"\n  {status.story}" if status.story else "")


@app.command()
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
        out.print_json(json.dumps({"id": record.id, "backend_id": record.backend_id,
                                   "name": record.name, "target": record.target,
                                   **dataclasses.asdict(state), "detail": detail}))
        return
    out.print(_status_line(record, state), markup=False)
    for line in detail:
        out.print(f"  {line}", markup=False)


@app.command()
def logs(
    job: JobArg,
    follow_: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job "
                                          "ends.")] = False,
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


@app.command()
def cancel(job: JobArg) -> None:
    """Cancel a submitted job."""
    record, backend = find_job(job)
    try:
        backend.cancel(record)
    except RuntimeError as exc:
        fail(str(exc), code=exitcodes.FAILED)
    err.print(f"cancelled {record.backend_id or record.id}")


@app.command()
def wait(
    job: JobArg,
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds "
                                                  "(exit 1).")] = None,
    poll: Annotated[float, typer.Option(help="Seconds between checks.")] = 2.0,
) -> None:
    """Wait until a job ends; exit 0 if it completed, 86 on an OOM, 1 otherwise."""
    import time

    from ctxlaunch.launch.backends.base import WAIT_EXIT

    record, backend = find_job(job)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            state = backend.status(record)
        except KeyError:
            fail(f"the scheduler no longer knows job {record.backend_id}")
        except RuntimeError as exc:
            fail(str(exc), code=exitcodes.FAILED)
        if state.terminal:
            break
        if deadline is not None and time.monotonic() > deadline:
            out.print(_status_line(record, state), markup=False)
            fail(f"still {state.state} after {timeout:g} s", code=exitcodes.FAILED)
        time.sleep(poll)
    out.print(_status_line(record, state), markup=False)
    for line in backend.explain(record, state):
        out.print(f"  {line}", markup=False)
    raise typer.Exit(WAIT_EXIT.get(state.state, exitcodes.FAILED))


@app.command(name="list")
def list_jobs(
    limit: Annotated[int, typer.Option(help="Show the newest this many.")] = 20,
) -> None:
    """The jobs submitted from this machine, newest last, with their current state."""
    import time

    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends import get_backend

    table = Table()
    for column in ("job", "name", "target", "scheduler id", "state", "submitted"):
        table.add_column(column)
    for record in jobstore.all_records()[-limit:]:
        try:
            state = get_backend(record.target).status(record).state
        except (KeyError, RuntimeError):  # NotImplementedError is a RuntimeError
            state = "UNKNOWN"
        table.add_row(record.id, record.name, record.target, record.backend_id, state,
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)))
    out.print(table)


@app.command()
def sweep(
    definition: Annotated[Path, typer.Argument(help="Sweep file (YAML, top-level `sweep:`).",
                                               show_default=False)],
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Show the points and what would be submitted.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Also submit points the planner predicts will not fit.")] = False,
) -> None:
    """Expand a sweep into jobs and submit them.

    On Slurm the points that share resources go as one job array; locally they run one after
    another. Prints the sweep id for `report`."""
    from ctxlaunch.launch import sweep as sweeps

    try:
        spec_def, points = sweeps.load_sweep(definition, set_ or ())
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    runnable, reasons = sweeps.triage(points, force)
    table = Table(title=f"sweep {spec_def.name}: {len(points)} points, {len(runnable)} to run",
                  title_justify="left")
    for column in ("name", *spec_def.axes, "runs"):
        table.add_column(column)
    for point in points:
        table.add_row(point.name, *(str(v) for v in point.values.values()),
                      "yes" if point.index not in reasons else "no: " + reasons[point.index])
    err.print(table)
    if not runnable:
        fail("no point of the sweep can run")
    submission = sweeps.prepare(spec_def.name, runnable)
    if dry_run:
        for dryrun in submission.dryruns:
            sys.stdout.write(dryrun.describe())
        return
    try:
        sweep_id = sweeps.submit(spec_def.name, spec_def.axes, points, reasons, submission,
                                 log=err.print)
    except RuntimeError as exc:  # the scheduler refused a group: nothing of it was submitted
        fail(str(exc))
    err.print(f"sweep {sweep_id}: `ctxlaunch report {sweep_id}` for the results")
    print(sweep_id)


@app.command()
def report(
    sweep_id: Annotated[str, typer.Argument(help="The id `ctxlaunch sweep` printed.",
                                            show_default=False)],
    csv_path: Annotated[Path | None, typer.Option("--csv", help="Also write the table as "
                                                   "CSV.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    plots: Annotated[Path | None, typer.Option(
        "--plots", help="Write PNG plots (tokens/s/GPU, MFU, peak memory against sequence "
        "length) into this directory.")] = None,
    html_path: Annotated[Path | None, typer.Option(
        "--html", help="Write one self-contained HTML page (plots and table).")] = None,
) -> None:
    """A sweep's results against the models' predictions, one row per point.

    Each row: the point's axis values, its state, measured tokens/s/GPU, step time, final loss
    and peak memory, and the predicted step time (its error), tokens/s/GPU, MFU in both
    conventions and peak memory."""
    from ctxlaunch.contract.fsutil import atomic_write_bytes, atomic_write_text
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.report import build_report, html_page, plot_pngs
    from ctxlaunch.perf.machine import load_calibration

    try:
        data = jobstore.load_sweep(sweep_id)
    except KeyError:
        fail(f"no sweep {sweep_id!r} in {jobstore.sweeps_root()}")
    if plots is not None and plots.exists() and not plots.is_dir():
        fail(f"--plots: {plots} exists and is not a directory")
    result = build_report(data, load_calibration())
    if csv_path is not None:
        atomic_write_text(csv_path, result.csv_text())
    if plots is not None or html_path is not None:
        pngs = plot_pngs(result)
        for name, png in pngs.items() if plots is not None else ():
            err.print(f"wrote {atomic_write_bytes(plots / name, png)}")
        if html_path is not None:
            err.print(f"wrote {atomic_write_text(html_path, html_page(result, pngs))}")
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
        return
    table = Table(title=f"sweep {data['name']} ({data['id']})", title_justify="left")
    shown = ["name", *data["axes"], "state", "step_seconds", "predicted_step_seconds",
             "step_error", "tokens_per_second_per_gpu", "predicted_tokens_per_second_per_gpu",
             "mfu_causal", "predicted_mfu_causal", "peak_memory_gib",
             "predicted_peak_memory_gib", "final_loss"]
    for column in shown:
        table.add_column(column.replace("predicted_", "pred. ").replace("_", " "),
                         justify="left" if column in ("name", "state") else "right")
    for row in result.rows:
        table.add_row(*("" if row.get(c) is None else
                        f"{row[c]:+.1%}" if c == "step_error" else
                        f"{row[c]:,.4g}" if isinstance(row.get(c), float) else str(row[c])
                        for c in shown))
    out.print(table)


@app.command()
def train(
    spec: Annotated[Path | None, typer.Argument(
        help="Job spec; default: $CTXLAUNCH_SPEC_JSON.", show_default=False)] = None,
    set_: SetOpt = None,
    run_dir: Annotated[str | None, typer.Option(
        "--run-dir", help="Where metrics.jsonl and summary.json go.")] = None,
) -> None:
    """Run one rank of the bundled trainer (what torchrun, srun or a PyTorchJob pod starts)."""
    from ctxlaunch.runtime.trainer.main import main as trainer_main

    argv = [str(spec)] if spec else []
    for item in set_ or ():
        argv += ["--set", item]
    if run_dir:
        argv += ["--run-dir", run_dir]
    raise typer.Exit(trainer_main(argv))


@app.command()
def schema() -> None:
    """Print the job spec's JSON Schema (for editor completion and validation)."""
    from ctxlaunch.contract.spec import json_schema

    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")


def main() -> None:
    # `submit --dry-run=server` (kubectl's spelling): the option parser has no optional-value
    # flags, so that one spelling is read as the hidden --dry-run-server.
    sys.argv = ["--dry-run-server" if arg == "--dry-run=server" else
                "--dry-run" if arg == "--dry-run=client" else arg for arg in sys.argv]
    app()


if __name__ == "__main__":
    main()
