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
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from ctxlaunch.perf.accounting import Accounting


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
    sizes = [len(values) for values in definition.axes.values()]
    count = math.prod(sizes)
    if count > MAX_SWEEP_POINTS:
        # Counted before anything is expanded: validating each point takes tens of
        # milliseconds, and 10^8 of them would run for years.
        raise SpecError(
            str(path),
            [
                Problem(
                    "sweep.axes",
                    f"{' x '.join(map(str, sizes))} values make {count:,} points; a sweep holds "
                    f"at most {MAX_SWEEP_POINTS:,}",
                )
            ],
        )
    base = apply_overrides(
        read_spec_data(path.parent / definition.base),
        # A YAML date is text to a spec: default=str keeps it what the spec's field reads.
        [f"{k}={json.dumps(v, default=str)}" for k, v in definition.set.items()] + list(overrides),
    )
    return definition, expand(definition, base, str(path))


MAX_SWEEP_POINTS = 1000
"""The most points a sweep expands to (the product of its axes' lengths): Slurm's default
MaxArraySize (1001) holds them as one job array."""
CHECKPOINT_DIR = "training.checkpoint.dir"


def expand(definition: SweepDefinition, base: dict[str, Any], source: str = "") -> list[Point]:
    """Every point of the sweep: the base with the point's axis values, named by them, each
    checkpointing in its own directory under the base's (`<dir>/<point name>`) unless an axis
    sets the directory itself; SpecError when two points would get one name."""
    axes = list(definition.axes.items())
    points: list[Point] = []
    named: dict[str, dict[str, Any]] = {}
    for index, combination in enumerate(itertools.product(*(values for _, values in axes))):
        values = dict(zip((path for path, _ in axes), combination, strict=True))
        name = point_name(definition.name, combination)
        if name in named:
            raise SpecError(
                source or definition.name,
                [
                    Problem(
                        "sweep.axes",
                        f"the points {named[name]} and {values} would both be named {name}",
                    )
                ],
            )
        named[name] = values
        data = apply_overrides(
            base,
            [f"{k}={json.dumps(v, default=str)}" for k, v in values.items()] + [f"name={name}"],
        )
        own_dir = _own_checkpoint_dir(data, name)
        if own_dir is not None and CHECKPOINT_DIR not in values:
            data = apply_overrides(data, [f"{CHECKPOINT_DIR}={json.dumps(own_dir)}"])
        try:
            points.append(Point(index, values, name, validate_spec(data, name)))
        except SpecError as exc:
            points.append(Point(index, values, name, None, "; ".join(str(p) for p in exc.problems)))
    return points


def _own_checkpoint_dir(data: dict[str, Any], name: str) -> str | None:
    """The point's own checkpoint directory under the base's (None: the base has none), so a
    point never resumes from another point's steps."""
    training = data.get("training")
    checkpoint = training.get("checkpoint") if isinstance(training, dict) else None
    directory = checkpoint.get("dir") if isinstance(checkpoint, dict) else None
    return str(Path(directory) / name) if isinstance(directory, str) and directory else None


_PLAIN_WORD = re.compile(r"^[a-z0-9]+$")
"""An axis value that stands in a name as it is: lowercase letters and digits, no '-'."""


def _name_part(value: Any) -> tuple[str, bool]:
    """How `value` reads in a point's name, and whether it reads exactly (it can be told back
    from the name alone): a non-negative integer, or a word of lowercase letters and digits
    that is not all digits (so "1" the text is never 1 the number)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value), True
    if isinstance(value, str) and _PLAIN_WORD.fullmatch(value) and not value.isdigit():
        return value, True
    return re.sub(r"[^a-z0-9]+", "-", str(value).lower()).strip("-") or "x", False


def point_name(prefix: str, values: tuple[Any, ...]) -> str:
    """A stable, readable job name from the axis values, one per distinct point: values that
    read exactly are joined by '-' (each part holds no '-', so the parts split back into the
    values); otherwise (`a-b`, `a_b` and `A B` all read `a-b`) a digest of the values follows.
    A name over the job name's limit is the prefix and a digest."""
    parts = [_name_part(v) for v in values]
    digest = hashlib.sha256(json.dumps(list(values), sort_keys=True, default=str).encode())
    name = "-".join([prefix, *(part for part, _ in parts)])
    if not all(exact for _, exact in parts):
        name += "-" + digest.hexdigest()[:8]
    if len(name) <= MAX_JOB_NAME:
        return name
    return f"{prefix}-{digest.hexdigest()[:10]}"


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
        row[field] = _measured(summary.get(field)) if summary else None
    peaks = (summary or {}).get("peak_memory_bytes_per_rank")
    numbers = [n for n in map(_measured, peaks) if n is not None] if isinstance(peaks, list) else []
    row["peak_memory_gib"] = max(numbers) / 2**30 if numbers else None
    return row


def _measured(value: Any) -> float | None:
    """A summary's figure: a finite number, else None (a run file ctxlaunch did not write)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


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


def point_accounting(points: list[Point]) -> dict[int, Accounting]:
    """Each valid point's whole run at its predicted step (perf.accounting): time to train,
    GPU-hours, energy and cost, by point index."""
    from ctxlaunch.perf.accounting import account
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.steptime import predict_spec

    out = {}
    for point in points:
        if point.spec is not None:
            out[point.index] = account(
                point.spec, predict_spec(point.spec, machine_for(point.spec))
            )
    return out


def accounting_total(accounts: Iterable[Accounting]) -> dict[str, Any]:
    """The sweep's points together: their GPU-hours, energy and cost summed, and their time if
    they run one after another (a local sweep does)."""
    accounts = list(accounts)
    energies = [a.energy_kwh.value for a in accounts if a.energy_kwh is not None]
    costs = [a.cost.value for a in accounts if a.cost is not None]
    return {
        "points": len(accounts),
        "seconds_one_after_another": sum(a.seconds.value for a in accounts),
        "gpu_hours": sum(a.gpu_hours.value for a in accounts),
        "energy_kwh": sum(energies) if len(energies) == len(accounts) and accounts else None,
        "cost": sum(costs) if len(costs) == len(accounts) and accounts else None,
    }


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
