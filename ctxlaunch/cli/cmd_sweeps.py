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
    accounts = {
        index: a for index, a in sweeps.point_accounting(runnable).items() if index not in reasons
    }
    err.print(sweep_points_table(spec_def, points, len(runnable), reasons, accounts))
    total = sweeps.accounting_total(accounts.values())
    err.print(_total_line(total), markup=False)
    if not runnable:
        fail("no point of the sweep can run")
    submission = sweeps.prepare(spec_def.name, runnable)
    if dry_run:
        if as_json:
            listed = {
                "name": spec_def.name,
                "points": _points_json(points, reasons, accounts),
                "total": total,
                "submissions": [dryrun_dict(d) for d in submission.dryruns],
            }
            out.print_json(json.dumps(listed))
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
        out.print_json(json.dumps({**_sweep_jobs(sweep_id, accounts), "total": total}))
        return
    print(sweep_id)


def _total_line(total: dict[str, Any]) -> str:
    """The runnable points together: GPU-hours, energy, cost, and their time one after another."""
    from ctxlaunch.perf.accounting import amount, duration, energy

    parts = [
        f"{total['points']} points to run: {amount(total['gpu_hours'])} GPU-hours",
    ]
    if total["energy_kwh"] is not None:
        parts.append(energy(total["energy_kwh"]))
    if total["cost"] is not None:
        parts.append(f"cost {amount(total['cost'])}")
    parts.append(f"{duration(total['seconds_one_after_another'])} one after another")
    return ", ".join(parts)


def _points_json(
    points: list[Any], reasons: dict[int, str], accounts: dict[int, Any]
) -> list[dict[str, Any]]:
    """Each point with its values, whether it runs, and its run's accounting."""
    return [
        {
            "index": point.index,
            "name": point.name,
            "values": point.values,
            "runs": point.index not in reasons,
            "skipped": reasons.get(point.index),
            "accounting": accounts[point.index].to_dict() if point.index in accounts else None,
        }
        for point in points
    ]


def _sweep_jobs(sweep_id: str, accounts: dict[int, Any] | None = None) -> dict[str, Any]:
    """`sweep --json`: the sweep id and, per point, its job's ctxlaunch and scheduler ids (a
    local job's exit status), or why it was skipped, and its run's predicted accounting."""
    from ctxlaunch.launch import jobstore

    data = jobstore.load_sweep(sweep_id)
    points = []
    for point in data["points"]:
        entry = {k: point.get(k) for k in ("index", "name", "values", "job", "skipped")}
        run = (accounts or {}).get(point["index"])
        entry["accounting"] = run.to_dict() if run is not None else None
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
        str,
        typer.Argument(
            help="The id `ctxlaunch sweep` printed, or one job's (ctxlaunch's or the scheduler's).",
            show_default=False,
        ),
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
    """A sweep's (or one job's) results against the models' predictions, one row per job.

    Each row: the point's axis values, its state, measured tokens/s/GPU, step time, final loss
    and peak memory, and the predicted step time (its error), tokens/s/GPU, MFU in both
    conventions and peak memory."""
    from ctxlaunch import api
    from ctxlaunch.contract.fsutil import atomic_write_bytes, atomic_write_text
    from ctxlaunch.launch.report import html_page, plot_pngs

    if plots is not None and plots.exists() and not plots.is_dir():
        fail(f"--plots: {plots} exists and is not a directory")
    try:
        result = api.report(sweep_id)
    except (api.JobNotFound, api.ApiError) as exc:
        fail(str(exc))
    for problem in result.problems:  # named; the point's columns are left empty
        err.print(f"warning: {problem}", markup=False)
    data = result.sweep
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
