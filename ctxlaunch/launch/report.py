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
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _point_spec(entry: dict[str, Any], record: Any) -> Any:
    """The point's resolved spec: kept in the sweep record, else the job's spec.json."""
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.launch import jobstore

    data = entry.get("spec")
    if data is None and record is not None:
        path = jobstore.run_dir(record) / "spec.json"
        data = json.loads(path.read_text()) if path.is_file() else None
    return validate_spec(data, entry["name"]) if data is not None else None


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


def eval_columns(path: Path) -> dict[str, Any]:
    """The EVAL_FIELDS of a run's last evaluation in its eval.jsonl (None where it has none)."""
    row: dict[str, Any] = dict.fromkeys(EVAL_FIELDS)
    lines = path.read_text().splitlines() if path.is_file() else []
    if not lines:
        return row
    last = json.loads(lines[-1])
    row["eval_loss"] = last["loss"]
    scored = [b for b in last["buckets"] if b["tokens"]]
    row["eval_loss_longest"] = scored[-1]["loss"] if scored else None
    cells = last.get("passkey") or []
    trials = sum(c["trials"] for c in cells)
    row["passkey_retrieved"] = sum(c["retrieved"] for c in cells) / trials if trials else None
    return row


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
    for entry in sweep["points"]:
        record = None
        if entry["job"] is None:
            row = result_row(entry, "SKIPPED", None)
        else:
            record = jobstore.load(entry["job"])
            healing: tuple[str, ...] = ()
            try:
                status = get_backend(record.target).status(record)
                state, healing = status.state, status.healing
            except (KeyError, RuntimeError):  # NotImplementedError is a RuntimeError
                state = "UNKNOWN"
            summary_path = jobstore.run_dir(record) / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
            row = result_row(entry, state, summary)
            # training.heal: how often the point's layout was re-planned, and each re-plan.
            row["replans"] = len(healing)
            row["healing"] = "; then ".join(healing) or None
            row.update(eval_columns(jobstore.run_dir(record) / "eval.jsonl"))
        spec = _point_spec(entry, record)
        if spec is not None:
            predict_row(row, spec, calibration)
        rows.append(row)
    return SweepReport(sweep, rows)


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
