"""`sweep` and `report`: many jobs over a grid of settings, and their results."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ctxlaunch.cli.cmd_jobs import dryrun_dict
from ctxlaunch.cli.common import SetOpt, err, fail, out
from ctxlaunch.cli.extras import require
from ctxlaunch.cli.tables import report_table, sweep_points_table
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError


def sweep(
    definition: Annotated[
        Path, typer.Argument(help="Sweep file (YAML, top-level `sweep:`).", show_default=False)
    ],
    set_: SetOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show the points and what would be submitted.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Also submit points the planner predicts will not fit.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Machine-readable output: the sweep id and each point's job ids (local jobs' "
            "output goes to stderr), or with --dry-run what would be submitted.",
        ),
    ] = False,
) -> None:
    """Expand a sweep into jobs and submit them.

    On Slurm the points that share resources go as one job array; locally they run one after
    another. Prints the sweep id for `report`."""
    from ctxlaunch.launch import sweep as sweeps
    from ctxlaunch.launch.backends import get_backend

    try:
        spec_def, points = sweeps.load_sweep(definition, set_ or ())
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    runnable, reasons = sweeps.triage(points, force)
    err.print(sweep_points_table(spec_def, points, len(runnable), reasons))
    if not runnable:
        fail("no point of the sweep can run")
    submission = sweeps.prepare(spec_def.name, runnable)
    if dry_run:
        if as_json:
            out.print_json(json.dumps([dryrun_dict(d) for d in submission.dryruns]))
            return
        for dryrun in submission.dryruns:
            sys.stdout.write(dryrun.describe())
        return
    if get_backend(submission.target).runs_here:
        require("sweep", "torch")  # the points run here, one after another
    # With --json, stdout holds the JSON alone: what the jobs print goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        try:
            sweep_id = sweeps.submit(
                spec_def.name, spec_def.axes, points, reasons, submission, log=err.print
            )
        except RuntimeError as exc:  # the scheduler refused a group: nothing of it submitted
            fail(str(exc))
    err.print(f"sweep {sweep_id}: `ctxlaunch report {sweep_id}` for the results")
    if as_json:
        out.print_json(json.dumps(_sweep_jobs(sweep_id)))
        return
    print(sweep_id)


def _sweep_jobs(sweep_id: str) -> dict[str, Any]:
    """`sweep --json`: the sweep id and, per point, its job's ctxlaunch and scheduler ids (a
    local job's exit status), or why it was skipped."""
    from ctxlaunch.launch import jobstore

    data = jobstore.load_sweep(sweep_id)
    points = []
    for point in data["points"]:
        entry = {k: point.get(k) for k in ("index", "name", "values", "job", "skipped")}
        if point.get("job"):
            try:
                record = jobstore.find(point["job"])
            except (KeyError, ValueError):  # recorded by the sweep, but its record is gone
                record = None
            entry["backend_id"] = record.backend_id if record else None
            if record is not None and "exit_status" in record.extra:
                entry["exit_status"] = record.extra["exit_status"]
        points.append(entry)
    return {
        "sweep_id": sweep_id,
        "name": data["name"],
        "target": data["target"],
        "points": points,
    }


def report(
    sweep_id: Annotated[
        str, typer.Argument(help="The id `ctxlaunch sweep` printed.", show_default=False)
    ],
    csv_path: Annotated[
        Path | None, typer.Option("--csv", help="Also write the table as CSV.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    plots: Annotated[
        Path | None,
        typer.Option(
            "--plots",
            help="Write PNG plots (tokens/s/GPU, MFU, peak memory against sequence "
            "length) into this directory.",
        ),
    ] = None,
    html_path: Annotated[
        Path | None,
        typer.Option("--html", help="Write one self-contained HTML page (plots and table)."),
    ] = None,
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
    except ValueError as exc:  # a reference no sweep can have, or a damaged record
        fail(str(exc))
    if plots is not None and plots.exists() and not plots.is_dir():
        fail(f"--plots: {plots} exists and is not a directory")
    result = build_report(data, load_calibration())
    for problem in result.problems:  # named; the point's columns are left empty
        err.print(f"warning: {problem}", markup=False)
    if csv_path is not None:
        atomic_write_text(csv_path, result.csv_text())
    if plots is not None or html_path is not None:
        pngs = plot_pngs(result)
        if plots is not None:
            for name, png in pngs.items():
                err.print(f"wrote {atomic_write_bytes(plots / name, png)}")
        if html_path is not None:
            err.print(f"wrote {atomic_write_text(html_path, html_page(result, pngs))}")
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
        return
    out.print(report_table(data, result.rows))
