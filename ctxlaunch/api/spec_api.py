"""Specs from files, mappings or keyword sections, validated into a `JobSpec`, with every
problem listed (`SpecError`) and the warnings said, never printed."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxlaunch.contract.loader import (
    Problem,
    SpecError,
    apply_overrides,
    read_spec_data,
    validate_spec,
)
from ctxlaunch.contract.spec import JobSpec

SpecLike = JobSpec | str | Path | Mapping[str, Any]
"""What the API takes as a spec: a validated JobSpec, the path of a YAML file, or its mapping."""


def spec_data(
    spec: str | Path | Mapping[str, Any], overrides: Iterable[str] = ()
) -> dict[str, Any]:
    """The spec's mapping (a file's YAML, or a copy of `spec`) with `path=value` overrides
    applied; SpecError when the file cannot be read."""
    data = read_spec_data(spec) if isinstance(spec, (str, Path)) else json.loads(json.dumps(spec))
    return apply_overrides(data, list(overrides))


def load_spec(spec: SpecLike, overrides: Iterable[str] = (), **forced: Any) -> JobSpec:
    """A validated JobSpec from a file, a mapping or a JobSpec, with `path=value` overrides and
    `forced` fields (dotted paths as keyword names are not Python: pass them as
    **{"cluster.target": "slurm"}); SpecError listing every problem."""
    overrides = list(overrides) + [f"{k}={json.dumps(v)}" for k, v in forced.items()]
    if isinstance(spec, JobSpec):
        if not overrides:
            return spec
        spec = spec.model_dump(mode="json")
    source = str(spec) if isinstance(spec, (str, Path)) else "<spec>"
    return validate_spec(spec_data(spec, overrides), source)


def build_spec(
    name: str,
    *,
    model: Mapping[str, Any],
    training: Mapping[str, Any],
    **sections: Mapping[str, Any],
) -> JobSpec:
    """A JobSpec from its sections as keyword arguments (model, training, and any of parallel,
    cluster, fabric, telemetry); SpecError listing every problem."""
    data = {"name": name, "model": dict(model), "training": dict(training)}
    data.update({key: dict(value) for key, value in sections.items()})
    return validate_spec(data, f"<spec {name}>")


@dataclass(frozen=True)
class Validation:
    """A spec checked: valid (`spec` set, with its warnings) or not (every problem)."""

    ok: bool
    spec: JobSpec | None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": [{"path": p.path, "message": p.message} for p in self.problems],
            "warnings": self.warnings,
        }


def validate(spec: SpecLike, overrides: Iterable[str] = ()) -> Validation:
    """Check a spec without raising on its problems: a Validation holding the spec and its
    warnings, or every problem."""
    try:
        job = load_spec(spec, overrides)
    except SpecError as exc:
        return Validation(ok=False, spec=None, problems=exc.problems)
    return Validation(ok=True, spec=job, warnings=job.warnings())
