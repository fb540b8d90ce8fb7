"""A job measured against its plan: the step time, peak memory, MFU and tokens/s its run reported,
beside what the planner and the step-time model predicted for it, with the difference in per
cent, and how far the run has got.

What was measured comes from the run's own files (rank 0's metrics.jsonl while it runs, its
summary.json once it is done, in the run directory a local or Slurm job shares with the
submitter), or for a pod from the summary its entry hands back in its log. What was predicted
is the prediction the trainer itself made and wrote beside its figures, else the same
prediction made again from the spec the job was submitted with (perf.accounting.job_prediction,
one function for both sides).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxlaunch.contract.hardware import GiB
from ctxlaunch.launch import jobstore

if TYPE_CHECKING:
    from ctxlaunch.launch.backends.base import Backend, Status
    from ctxlaunch.launch.jobstore import JobRecord


@dataclass(frozen=True)
class Figure:
    """One quantity, measured and predicted."""

    name: str
    unit: str
    measured: float | None
    predicted: float | None

    @property
    def difference(self) -> float | None:
        """measured / predicted - 1 (None where either is missing)."""
        if self.measured is None or not self.predicted:
            return None
        return self.measured / self.predicted - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "unit": self.unit,
            "measured": self.measured,
            "predicted": self.predicted,
            "difference": self.difference,
        }


@dataclass(frozen=True)
class Measured:
    """What a job's run has reported so far against its prediction."""

    source: str
    """Where the measured figures come from (a file, the pod's log), or why there are none."""
    step: int | None = None
    steps: int | None = None
    remaining_seconds: float | None = None
    expected_error: float = 0.0
    """The predicted step's expected relative error (0: not known on its machine)."""
    figures: list[Figure] = field(default_factory=list)

    @property
    def progress(self) -> float | None:
        if self.step is None or not self.steps:
            return None
        return min(self.step / self.steps, 1.0)

    @property
    def step_drift(self) -> float | None:
        """The measured step's difference from the predicted one."""
        return next((f.difference for f in self.figures if f.name == "step time"), None)

    @property
    def step_within_error(self) -> bool | None:
        """Whether the measured step is within the prediction's expected error (None: no
        error known, or nothing measured)."""
        drift = self.step_drift
        if drift is None or not self.expected_error:
            return None
        return abs(drift) <= self.expected_error

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "step": self.step,
            "steps": self.steps,
            "progress": self.progress,
            "remaining_seconds": self.remaining_seconds,
            "expected_error": self.expected_error,
            "step_within_error": self.step_within_error,
            "figures": [f.to_dict() for f in self.figures],
        }

    def lines(self) -> list[str]:
        """The comparison for `status`: progress, then one line per quantity."""
        from ctxlaunch.perf.accounting import duration

        out = []
        if self.step is not None and self.steps:
            left = (
                f", {duration(self.remaining_seconds)} left"
                if self.remaining_seconds is not None and self.step < self.steps
                else ""
            )
            out.append(
                f"progress: step {self.step:,} of {self.steps:,} ({self.progress:.0%}){left}"
            )
        if not self.figures:
            return out + [f"measured against predicted: {self.source}"]
        error = (
            f"; the step's expected error +/-{self.expected_error:.0%}"
            if self.expected_error
            else "; the step's expected error is not known here"
        )
        out.append(f"measured against predicted ({self.source}{error}):")
        for f in self.figures:
            measured = "-" if f.measured is None else _shown(f.measured, f.unit)
            predicted = "-" if f.predicted is None else _shown(f.predicted, f.unit)
            diff = "" if f.difference is None else f"  {f.difference:+.1%}"
            out.append(f"  {f.name:<12} {measured:>14}  predicted {predicted:>14}{diff}")
        within = self.step_within_error
        if within is not None:
            out.append(
                "  the step is within the expected error"
                if within
                else "  the step has drifted past the expected error"
            )
        return out


def _shown(value: float, unit: str) -> str:
    if unit == "GiB":
        return f"{value:,.2f} GiB"
    if unit == "s":
        return f"{value:.4g} s"
    if unit == "ratio":
        return f"{value:.1%}"
    return f"{value:,.0f} {unit}"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line the run was writing when it was read
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _from_steps(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured figures of a running job from rank 0's step lines (the first, warm-up step
    left out once there are others)."""
    timed = rows[1:] or rows
    last = rows[-1]
    return {
        "step": last.get("step"),
        "steps": last.get("steps") or None,
        "remaining_seconds": last.get("remaining_seconds"),
        "step_seconds": _mean([r["step_seconds"] for r in timed if "step_seconds" in r]),
        "tokens_per_second_per_gpu": _mean(
            [r["tokens_per_second_per_gpu"] for r in timed if "tokens_per_second_per_gpu" in r]
        ),
        "tflops": {
            c: _mean(
                [r[f"model_tflops_per_gpu_{c}"] for r in timed if f"model_tflops_per_gpu_{c}" in r]
            )
            for c in ("full", "causal")
        },
        "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0 for r in rows), default=0)
        or None,
        "memory_of": "rank 0",
    }


def _from_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The measured figures of a finished run from its summary."""
    peaks = summary.get("peak_memory_bytes_per_rank") or []
    return {
        "step": summary.get("steps"),
        "steps": (summary.get("predicted") or {}).get("steps") or summary.get("steps"),
        "remaining_seconds": 0.0,
        "step_seconds": summary.get("step_seconds"),
        "tokens_per_second_per_gpu": summary.get("tokens_per_second_per_gpu"),
        "tflops": summary.get("model_tflops_per_gpu") or {},
        "peak_memory_bytes": max(peaks) if peaks else None,
        "memory_of": "busiest rank",
    }


def _summary_from_log(record: JobRecord, backend: Backend) -> dict[str, Any] | None:
    """The summary a pod's entry hands back in its log (its result line), if any."""
    try:
        result = backend.result(record)
    except (ValueError, RuntimeError, KeyError):
        return None
    return result if isinstance(result, dict) and "step_seconds" in result else None


def measured_against_predicted(
    record: JobRecord, backend: Backend, status: Status | None = None
) -> Measured:
    """What `record`'s run has measured against its prediction (see the module docstring)."""
    directory = jobstore.run_dir(record)
    summary = _json(directory / "summary.json")
    source = f"{directory}/summary.json"
    rows: list[dict[str, Any]] = []
    if summary is None:
        rows = _jsonl(directory / "metrics.jsonl")
        source = f"{directory}/metrics.jsonl"
    if summary is None and not rows and status is not None and status.terminal:
        summary = _summary_from_log(record, backend)
        source = "the summary in its log"
    if summary is None and not rows:
        try:
            reported = backend.reported_progress(record)
        except (KeyError, RuntimeError):  # the scheduler cannot be asked: nothing reported
            reported = None
        if reported is not None:
            rows, source = [reported], "the progress the job reports to its scheduler"
    if summary is None and not rows:
        return Measured(source="no step measured yet, or its run's files are not readable here")
    measured = _from_summary(summary) if summary is not None else _from_steps(rows)
    prediction, machine = _prediction(record, summary)
    if prediction is None:
        return Measured(
            source=source + "; no prediction: the job's spec is not recorded",
            step=measured["step"],
            steps=measured["steps"],
            remaining_seconds=measured["remaining_seconds"],
        )
    reference = machine.peak_reference_flops or machine.peak_flops["bf16"] if machine else None
    mfu = {
        c: (v * 1e12 / reference if v is not None and reference else None)
        for c, v in measured["tflops"].items()
    }
    peak = measured["peak_memory_bytes"]
    figures = [
        Figure("step time", "s", measured["step_seconds"], prediction.step_seconds),
        Figure(
            "peak memory",
            "GiB",
            peak / GiB if peak else None,
            prediction.peak_memory_bytes / GiB,
        ),
        Figure("MFU causal", "ratio", mfu.get("causal"), prediction.mfu.get("causal")),
        Figure("MFU full", "ratio", mfu.get("full"), prediction.mfu.get("full")),
        Figure(
            "tokens/s/GPU",
            "tokens/s",
            measured["tokens_per_second_per_gpu"],
            prediction.tokens_per_second_per_gpu,
        ),
    ]
    return Measured(
        source=f"{source}, peak memory of the {measured['memory_of']}",
        step=measured["step"],
        steps=measured["steps"] or prediction.steps,
        remaining_seconds=measured["remaining_seconds"],
        expected_error=prediction.expected_error,
        figures=figures,
    )


def _prediction(record: JobRecord, summary: dict[str, Any] | None) -> tuple[Any, Any]:
    """(the job's prediction, the machine its MFU is stated on): the trainer's own where its
    summary holds it, else made again from the recorded spec; (None, None) without a spec."""
    from ctxlaunch.contract.loader import SpecError, validate_spec
    from ctxlaunch.perf.accounting import Prediction, job_prediction
    from ctxlaunch.perf.machine import machine_for

    data = jobstore.recorded_spec(record)
    spec = None
    if data is not None:
        try:
            spec = validate_spec(data, record.id)
        except SpecError:
            spec = None
    machine = machine_for(spec) if spec is not None else None
    own = (summary or {}).get("predicted")
    if isinstance(own, dict):
        try:
            return Prediction.from_dict(own), machine
        except ValueError:
            pass
    if spec is None or machine is None:
        return None, None
    return job_prediction(spec, machine), machine
