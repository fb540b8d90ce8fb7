"""Sweeps: one definition (a base spec and axes such as sequence length x CP degree x
algorithm) expanded into job specs with stable names, grouped for submission, and their results
gathered into one table.

    sweep:
      name: demo-sweep
      base: demo.yaml              # a job spec, relative to this file
      set:                         # overrides every point shares
        training.steps: 20
      axes:                        # the cartesian product, first axis outermost
        training.seq_len: [4096, 8192]
        parallel.cp_algorithm: [ring, ulysses]

Points the layout rules reject are reported with the reason and left out; the rest run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ctxlaunch.contract.loader import (
    Problem,
    SpecError,
    apply_overrides,
    read_spec_data,
    validate_spec,
)
from ctxlaunch.contract.spec import MAX_JOB_NAME, RFC1123_LABEL, JobSpec
from ctxlaunch.launch.backends.base import DryRun


class SweepDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str
    """Prefix of every point's job name (RFC 1123, at most 32 characters)."""
    base: str
    """The job spec every point starts from, relative to the sweep file."""
    set: dict[str, Any] = {}
    """Field overrides (dotted paths) applied to every point."""
    axes: dict[str, list[Any]] = Field(min_length=1)
    """Dotted field path -> the values to sweep; points are the cartesian product."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > 32 or not RFC1123_LABEL.fullmatch(value):
            raise ValueError(f"{value!r}: lowercase letters, digits and '-', at most 32")
        return value

    @field_validator("axes")
    @classmethod
    def _axes(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for path, values in value.items():
            if not values:
                raise ValueError(f"axis {path!r} has no values")
        return value


@dataclass(frozen=True)
class Point:
    index: int
    values: dict[str, Any]
    """The axis values of this point, in axis order."""
    name: str
    spec: JobSpec | None
    problem: str | None = None
    """Why the point cannot run (the spec's own error), when it cannot."""


def load_sweep(
    path: str | Path, overrides: Iterable[str] = ()
) -> tuple[SweepDefinition, list[Point]]:
    """Read a sweep file and expand it; `overrides` (path=value) apply to every point after
    the file's own `set`."""
    path = Path(path)
    data = read_spec_data(path)
    if set(data) != {"sweep"}:
        raise SpecError(str(path), [Problem("", "a sweep file has one top-level key, `sweep`")])
    try:
        definition = SweepDefinition.model_validate(data["sweep"])
    except ValidationError as exc:
        raise SpecError(
            str(path),
            [
                Problem(
                    "sweep." + ".".join(map(str, e["loc"])), e["msg"].removeprefix("Value error, ")
                )
                for e in exc.errors()
            ],
        ) from None
    base = apply_overrides(
        read_spec_data(path.parent / definition.base),
        [f"{k}={json.dumps(v)}" for k, v in definition.set.items()] + list(overrides),
    )
    return definition, expand(definition, base)


def expand(definition: SweepDefinition, base: dict[str, Any]) -> list[Point]:
    axes = list(definition.axes.items())
    points = []
    for index, combination in enumerate(itertools.product(*(values for _, values in axes))):
        values = dict(zip((path for path, _ in axes), combination, strict=True))
        name = point_name(definition.name, combination)
        data = apply_overrides(
            base, [f"{k}={json.dumps(v)}" for k, v in values.items()] + [f"name={name}"]
        )
        try:
            points.append(Point(index, values, name, validate_spec(data, name)))
        except SpecError as exc:
            points.append(Point(index, values, name, None, "; ".join(str(p) for p in exc.problems)))
    return points


def point_name(prefix: str, values: tuple[Any, ...]) -> str:
    """A stable, readable job name from the axis values (hashed when too long)."""
    parts = [re.sub(r"[^a-z0-9]+", "-", str(v).lower()).strip("-") or "x" for v in values]
    name = "-".join([prefix, *parts])
    if len(name) <= MAX_JOB_NAME:
        return name
    digest = hashlib.sha256(json.dumps(list(map(str, values))).encode()).hexdigest()[:10]
    return f"{prefix}-{digest}"


def slurm_groups(points: list[Point]) -> list[list[Point]]:
    """Runnable points whose Slurm scripts differ only by spec and name: each group is one job
    array (same resources, same environment)."""
    from ctxlaunch.launch.backends.slurm import SlurmBackend

    runnable = [point for point in points if point.spec is not None]
    groups = SlurmBackend().sweep_groups([point.spec for point in runnable if point.spec])
    return [[runnable[index] for index in group] for group in groups]


RESULT_FIELDS = (
    "tokens_per_second_per_gpu",
    "step_seconds",
    "final_loss",
    "attention_balance",
    "aux_loss",
    "expert_load",
)
"""From the run's summary.json; attention_balance is the mean over its steps of the busiest CP
rank's attention area over its group's mean (1 where CP is 1 or the ranks are balanced); for a
mixture of experts, aux_loss the last step's load-balancing loss and expert_load the mean over
its steps of the busiest expert's routings over the mean (empty for a dense model)."""


def result_row(
    point_record: dict[str, Any], state: str, summary: dict[str, Any] | None
) -> dict[str, Any]:
    row = {"name": point_record["name"], **point_record["values"], "state": state}
    for field in RESULT_FIELDS:
        row[field] = summary.get(field) if summary else None
    peaks = (summary or {}).get("peak_memory_bytes_per_rank") or []
    row["peak_memory_gib"] = max(peaks) / 2**30 if peaks else None
    return row


# --------------------------------------------------------------------------------------------
# running a sweep (what `ctxlaunch sweep` does)
# --------------------------------------------------------------------------------------------
def triage(points: list[Point], force: bool = False) -> tuple[list[Point], dict[int, str]]:
    """(the points to run, why each other point is skipped): invalid specs, and points the
    planner predicts will not fit unless `force`."""
    from ctxlaunch.planning.plan import plan_job

    runnable, reasons = [], {}
    for point in points:
        if point.spec is None:
            reasons[point.index] = point.problem or "invalid"
        elif not force and not (report := plan_job(point.spec)).fits:
            reasons[point.index] = report.verdict()
        else:
            runnable.append(point)
    return runnable, reasons


@dataclass(frozen=True)
class Submission:
    """What a sweep submits: one dry run per group of points the backend submits together
    (a Slurm job array; elsewhere one point)."""

    target: str
    groups: list[list[Point]]
    dryruns: list[DryRun]
    sweep_id: str


def _specs(points: list[Point]) -> list[JobSpec]:
    return [point.spec for point in points if point.spec is not None]


def prepare(name: str, runnable: list[Point]) -> Submission:
    """Group the runnable points as their backend submits them and make the dry runs: one
    Slurm array per group of points that can share one, one PyTorchJob per point on
    Kubernetes (all labelled with the sweep), one local run per point."""
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends import get_backend

    target = _specs(runnable)[0].cluster.target
    backend = get_backend(target)
    sweep_id = jobstore.new_id("sweep", name)
    groups = [
        [runnable[index] for index in group] for group in backend.sweep_groups(_specs(runnable))
    ]
    dryruns = [
        backend.sweep_dryrun(sweep_id, f"{name}-{i}" if len(groups) > 1 else name, _specs(group))
        for i, group in enumerate(groups)
    ]
    return Submission(target, groups, dryruns, sweep_id)


def submit(
    name: str,
    axes: Iterable[str],
    points: list[Point],
    reasons: dict[int, str],
    submission: Submission,
    log: Callable[[str], object] = print,
) -> str:
    """Submit (Slurm arrays) or run (locally, one after another) the prepared points and save
    the sweep's record; returns the sweep id for `ctxlaunch report`. A scheduler's refusal
    raises RuntimeError (nothing of that group was submitted); a point refused on its own (a
    PyTorchJob of that name exists) is logged and skipped, and RuntimeError is raised only when
    every point was refused."""
    import time

    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.launch.backends.base import Refused

    backend = get_backend(submission.target)
    sweep_id = submission.sweep_id
    entries = {
        p.index: {
            "index": p.index,
            "name": p.name,
            "values": p.values,
            "job": None,
            "skipped": reasons.get(p.index),
            # the resolved spec, so `report` can predict the point
            "spec": p.spec.model_dump(mode="json") if p.spec else None,
        }
        for p in points
    }
    refused = 0
    for group, dryrun in zip(submission.groups, submission.dryruns, strict=True):
        try:
            jobs = backend.schedule_sweep(dryrun, _specs(group))
        except Refused as exc:  # e.g. a job of that name exists: the others still go
            log(f"[yellow]warning:[/] {group[0].name} not submitted: {exc}")
            entries[group[0].index]["skipped"] = str(exc)
            refused += 1
            continue
        for point, job_id in zip(group, jobs.job_ids, strict=False):
            entries[point.index]["job"] = job_id
        if jobs.note:
            log(jobs.note)
    if refused == len(submission.groups):
        raise RuntimeError("no point of the sweep was submitted")
    jobstore.save_sweep(
        sweep_id,
        {
            "id": sweep_id,
            "name": name,
            "target": submission.target,
            "created": time.time(),
            "axes": list(axes),
            "points": [entries[i] for i in sorted(entries)],
        },
    )
    return sweep_id
