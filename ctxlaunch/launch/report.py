"""`ctxlaunch report`: a sweep's measured results beside what the models predicted, as a
table, CSV, PNG plots and one self-contained HTML page.

Each point's prediction comes from the same code `plan` and `advise` use: step time and MFU
from ctxlaunch.perf.steptime (on `gpu: cpu` with the constants `ctxlaunch calibrate` measured here),
peak memory from the planner. Measured MFU is stated against the same peak as the predicted one,
so the two are comparable.
"""

from __future__ import annotations

import base64
import html
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxlaunch.contract.bounded import (
    MAX_EVENTS_BYTES,
    MAX_STATE_BYTES,
    BoundedReadError,
    read_bounded_lines,
    read_bounded_object,
)
from ctxlaunch.contract.hardware import GiB
from ctxlaunch.launch.sweep import RESULT_FIELDS, result_row
from ctxlaunch.perf.flops import CONVENTIONS, flops_per_token

PREDICTED_FIELDS = (
    "predicted_step_seconds",
    "step_error",
    "predicted_tokens_per_second_per_gpu",
    "mfu_causal",
    "predicted_mfu_causal",
    "mfu_full",
    "predicted_mfu_full",
    "predicted_peak_memory_gib",
)
EVAL_FIELDS = ("eval_loss", "eval_loss_longest", "passkey_retrieved")
"""From the point's last evaluation (training.eval.interval): the held-out loss, the loss of
the longest context-length bucket, and the share of passkey probes retrieved."""


HEAL_FIELDS = ("replans", "healing")
"""training.heal: the point's re-plans (how many, and each in words: "OOM at step 5 with cp 2
ring; resumed at step 4 with cp 1, dp 2")."""


@dataclass(frozen=True)
class SweepReport:
    sweep: dict[str, Any]
    rows: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)
    """Run files that could not be read (each named, its columns left empty)."""

    @property
    def columns(self) -> list[str]:
        return [
            "name",
            *self.sweep["axes"],
            "state",
            *RESULT_FIELDS,
            "peak_memory_gib",
            *PREDICTED_FIELDS,
            *EVAL_FIELDS,
            *HEAL_FIELDS,
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"sweep": self.sweep["id"], "rows": self.rows}

    def csv_text(self) -> str:
        import csv

        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self.columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.rows)
        return buffer.getvalue()


def _point_spec(entry: dict[str, Any], record: Any, problems: list[str]) -> Any:
    """The point's resolved spec: kept in the sweep record, else the job's spec.json (None,
    with the reason in `problems`, where neither can be read)."""
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.launch import jobstore

    data = entry.get("spec")
    source = f"the sweep record's spec of {entry['name']}"
    if data is None and record is not None:
        path = jobstore.run_dir(record) / "spec.json"
        source = str(path)
        data = _run_file(path, problems, "the point's spec")
    try:
        return validate_spec(data, source) if data is not None else None
    except ValueError as exc:
        problems.append(f"{source}: not a valid spec ({str(exc).splitlines()[-1].strip()})")
        return None


def _run_file(path: Path, problems: list[str], what: str) -> dict[str, Any] | None:
    """A run's JSON record (summary.json, spec.json), read with bounds; None when it is not
    there, or (named in `problems`) cannot be read."""
    if not os.path.lexists(path):
        return None
    try:
        return read_bounded_object(path, MAX_STATE_BYTES, what)
    except BoundedReadError as exc:
        problems.append(str(exc))
        return None


def predict_row(row: dict[str, Any], spec: Any, calibration: Any) -> None:
    """Add the predicted columns (and the measured MFU) to a result row, in place."""
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.memory import estimate
    from ctxlaunch.perf.steptime import predict_spec

    machine = machine_for(spec, calibration=calibration, saved=False)
    time = predict_spec(spec, machine)
    memory = estimate(spec.model, Layout.from_spec(spec), spec.cluster.gpu_info)
    row["seq_len"] = spec.training.seq_len
    row["cp"] = spec.parallel.cp
    row["cp_algorithm"] = spec.parallel.cp_algorithm
    row["tp"] = spec.parallel.tp
    row["pp"] = spec.parallel.pp
    row["predicted_step_seconds"] = time.step_seconds
    row["predicted_tokens_per_second_per_gpu"] = time.tokens_per_second_per_gpu
    row["predicted_peak_memory_gib"] = memory.total / GiB
    row["terms_seconds"] = time.terms
    reference = machine.peak_reference_flops or machine.peak_flops["bf16"]
    measured = row.get("tokens_per_second_per_gpu")
    for convention in CONVENTIONS:
        row[f"predicted_mfu_{convention}"] = time.mfu[convention]
        row[f"mfu_{convention}"] = (
            measured * flops_per_token(spec.model, spec.training.seq_len, convention) / reference
            if measured
            else None
        )
    step = row.get("step_seconds")
    row["step_error"] = step and time.step_seconds / step - 1


def eval_columns(path: Path, problems: list[str] | None = None) -> dict[str, Any]:
    """The EVAL_FIELDS of a run's last evaluation in its eval.jsonl (None where it has none;
    a file that cannot be read, or a last line that is not an evaluation, is named in
    `problems`)."""
    row: dict[str, Any] = dict.fromkeys(EVAL_FIELDS)
    try:
        lines = read_bounded_lines(path, MAX_EVENTS_BYTES, "the evaluation log")
    except BoundedReadError as exc:
        if problems is not None:
            problems.append(str(exc))
        return row
    if not lines:
        return row
    last = lines[-1]
    try:
        loss = _number(last["loss"])
        scored = [b for b in last["buckets"] if b["tokens"]]
        longest = _number(scored[-1]["loss"]) if scored else None
        cells = last.get("passkey") or []
        trials = sum(_number(c["trials"]) for c in cells)
        retrieved = sum(_number(c["retrieved"]) for c in cells) / trials if trials else None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError):
        if problems is not None:
            problems.append(f"{path}: the last line is not an evaluation ctxlaunch wrote")
        return row
    row.update(eval_loss=loss, eval_loss_longest=longest, passkey_retrieved=retrieved)
    return row


def _number(value: Any) -> float:
    """A JSON number from a run file (TypeError for anything else, a bool included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    return value


def job_sweep(record: Any) -> dict[str, Any]:
    """One job as a sweep of one point (no axes), so `report JOB` is a sweep's report of it."""
    from ctxlaunch.launch import jobstore

    return {
        "kind": "job",
        "id": record.id,
        "name": record.name,
        "target": record.target,
        "created": record.created,
        "axes": [],
        "points": [
            {
                "index": 0,
                "name": record.name,
                "values": {},
                "job": record.id,
                "skipped": None,
                "spec": jobstore.recorded_spec(record),
            }
        ],
    }


def build_report(sweep: dict[str, Any], calibration: Any = None) -> SweepReport:
    """Every point of a sweep record: state, measured results, predictions."""
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends import get_backend

    rows = []
    problems: list[str] = []
    for entry in sweep["points"]:
        record = None
        if entry["job"] is None:
            row = result_row(entry, "SKIPPED", None)
        else:
            try:
                record = jobstore.load(entry["job"])
            except (KeyError, ValueError) as exc:  # gone, or damaged (named)
                problems.append(
                    str(exc)
                    if isinstance(exc, ValueError)
                    else f"no record of job {entry['job']!r} in {jobstore.jobs_root()}"
                )
        if record is not None:
            healing: tuple[str, ...] = ()
            try:
                status = get_backend(record.target).status(record)
                state, healing = status.state, status.healing
            # NotImplementedError is a RuntimeError; a damaged events file a ValueError
            except (KeyError, RuntimeError, ValueError):
                state = "UNKNOWN"
            run = jobstore.run_dir(record)
            summary = _run_file(run / "summary.json", problems, "the run's summary")
            row = result_row(entry, state, summary)
            # training.heal: how often the point's layout was re-planned, and each re-plan.
            row["replans"] = len(healing)
            row["healing"] = "; then ".join(healing) or None
            row.update(eval_columns(run / "eval.jsonl", problems))
        elif entry["job"] is not None:
            row = result_row(entry, "UNKNOWN", None)
        spec = _point_spec(entry, record, problems)
        if spec is not None:
            predict_row(row, spec, calibration)
        rows.append(row)
    return SweepReport(sweep, rows, problems)


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------
PLOTS = (
    (
        "tokens_per_second_per_gpu",
        "predicted_tokens_per_second_per_gpu",
        "tokens/s per GPU",
        "throughput",
    ),
    ("mfu_causal", "predicted_mfu_causal", "MFU (causal convention)", "mfu"),
    ("peak_memory_gib", "predicted_peak_memory_gib", "peak memory per rank (GiB)", "memory"),
)


def _series(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Rows by layout: (TP/PP degrees and CP algorithm as a label, CP degree)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if "predicted_step_seconds" in row:
            parts = [f"{axis} {row[axis]}" for axis in ("tp", "pp") if row.get(axis, 1) > 1]
            if row["cp"] > 1:
                parts.append(row["cp_algorithm"])
            label = ", ".join(parts) or "cp 1"
            groups.setdefault((label, row["cp"]), []).append(row)
    return {
        k: sorted(v, key=lambda r: r["seq_len"])
        for k, v in sorted(groups.items(), key=lambda i: i[0][::-1])
    }


def plot_pngs(report: SweepReport) -> dict[str, bytes]:
    """One PNG per metric against sequence length: a line per (algorithm, CP degree) for the
    prediction, points of the same colour for what was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(report.rows)
    out = {}
    for measured_key, predicted_key, label, name in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for i, ((algorithm, cp), rows) in enumerate(series.items()):
            colour = f"C{i % 10}"
            tag = algorithm if cp == 1 else f"{algorithm}, cp {cp}"
            ax.plot(
                [r["seq_len"] for r in rows],
                [r[predicted_key] for r in rows],
                "-",
                color=colour,
                label=f"{tag} (predicted)",
            )
            measured = [
                (r["seq_len"], r[measured_key]) for r in rows if r.get(measured_key) is not None
            ]
            if measured:
                ax.plot(*zip(*measured, strict=False), "o", color=colour, label=f"{tag} (measured)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.set_title(f"{report.sweep['name']}: {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        out[f"{name}.png"] = buffer.getvalue()
    return out


def html_page(report: SweepReport, pngs: dict[str, bytes]) -> str:
    """One self-contained page: the plots inline (data URIs) and the table."""
    columns = report.columns

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else html.escape(str(value))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{cell(row.get(c))}</td>" for c in columns) + "</tr>"
        for row in report.rows
    )
    images = "".join(
        f'<img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(data).decode()}">'
        for name, data in pngs.items()
    )
    title = html.escape(f"sweep {report.sweep['name']} ({report.sweep['id']})")
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>'
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
        "font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
        "img{max-width:48%;margin:4px}</style></head><body>"
        f"<h1>{title}</h1><p>Lines: predicted by ctxlaunch's step-time and memory models; "
        "points: measured. step_error = predicted / measured step time - 1.</p>"
        f"{images}<table><tr>{head}</tr>{body}</table></body></html>\n"
    )
