"""The local record of submitted jobs: one directory per job under $CTXLAUNCH_HOME/jobs
(default ~/.ctxlaunch/jobs) holding the resolved spec, the submitted artifact, the backend's
ids and, for local jobs, the run's logs and metrics."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ctxlaunch.contract.bounded import MAX_STATE_BYTES, BoundedReadError, read_bounded_object
from ctxlaunch.contract.fsutil import atomic_write_text
from ctxlaunch.contract.rundir import home

RECORD = "job.json"


@dataclass
class JobRecord:
    id: str
    """ctxlaunch's id: the Slurm job id, or local-/k8s- prefixed names."""
    name: str
    target: str
    created: float
    backend_id: str = ""
    """The scheduler's own id (Slurm job id, namespace/name)."""
    command: list[str] = field(default_factory=list)
    artifact: str | None = None
    """File name (in the job directory) of the submitted script or manifest."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def directory(self) -> Path:
        return jobs_root() / self.id


def jobs_root() -> Path:
    return home() / "jobs"


def new_id(target: str, name: str) -> str:
    """A ctxlaunch job id: target, job name, time and a random suffix."""
    return f"{target}-{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class DamagedRecord(ValueError):
    """A record under $CTXLAUNCH_HOME that cannot be read back (cut short, not UTF-8, not the
    object it should be, a field of the wrong type); the message names the file."""


MAX_REFERENCE_CHARS = 255
"""The longest job or sweep reference: a record's name is a file name (NAME_MAX), and a
scheduler's id is far shorter."""


def check_reference(reference: str, what: str = "job") -> None:
    """A ValueError for a reference no job or sweep can have: too long to be a file name, or
    holding a NUL byte (a reference is a name or an id, never a path)."""
    if len(reference) > MAX_REFERENCE_CHARS:
        raise ValueError(
            f"a {what} reference of {len(reference):,} characters: ids and names are at most "
            f"{MAX_REFERENCE_CHARS}"
        )
    if "\x00" in reference:
        raise ValueError(f"a {what} reference holds a NUL byte: ids and names are text")


def _store_name(reference: str) -> bool:
    """Whether `reference` can name an entry of the store: one path component, no more (an
    absolute or relative path would read a record outside it)."""
    return (
        bool(reference)
        and len(reference) <= MAX_REFERENCE_CHARS
        and "/" not in reference
        and "\x00" not in reference
        and reference not in (".", "..")
    )


def save(record: JobRecord) -> Path:
    record.directory.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(record.directory / RECORD, json.dumps(asdict(record), indent=2))


_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "name": (str,),
    "target": (str,),
    "created": (int, float),
    "backend_id": (str,),
    "command": (list,),
    "artifact": (str, type(None)),
    "extra": (dict,),
}


def read_record(path: Path) -> JobRecord:
    """The job record at `path`; DamagedRecord naming it when it cannot be one."""
    try:
        data = read_bounded_object(path, MAX_STATE_BYTES, "the job record")
    except BoundedReadError as exc:
        raise DamagedRecord(f"damaged job record {exc}") from None
    for name, types in _RECORD_TYPES.items():
        if name in data and (not isinstance(data[name], types) or isinstance(data[name], bool)):
            raise DamagedRecord(
                f"damaged job record {path}: {name} is a {type(data[name]).__name__}"
            )
    missing = [name for name in ("id", "name", "target", "created") if name not in data]
    unknown = sorted(set(data) - set(_RECORD_TYPES))
    if missing or unknown:
        raise DamagedRecord(
            f"damaged job record {path}: "
            + (f"no {', '.join(missing)}" if missing else f"unknown fields {', '.join(unknown)}")
        )
    if not all(isinstance(part, str) for part in data.get("command", [])):
        raise DamagedRecord(f"damaged job record {path}: command is not a list of words")
    if data["id"] != path.parent.name:
        raise DamagedRecord(
            f"damaged job record {path}: it says it is job {data['id'][:80]!r}, not the "
            "job of its directory"
        )
    return JobRecord(**data)


def load(job_id: str) -> JobRecord:
    """The record of the job `job_id` (a name inside the store, never a path): KeyError when
    there is none, DamagedRecord when it cannot be read."""
    if not _store_name(job_id):
        raise KeyError(job_id)
    path = jobs_root() / job_id / RECORD
    if not os.path.lexists(path):
        raise KeyError(job_id)
    return read_record(path)


def find(reference: str) -> JobRecord:
    """A job by its ctxlaunch id or by the scheduler's id (e.g. the Slurm job id). KeyError
    when no record has it; ValueError (DamagedRecord among them) for a reference no job can
    have or a record that cannot be read."""
    check_reference(reference)
    try:
        return load(reference)
    except KeyError:
        pass
    matches = [r for r in all_records() if r.backend_id == reference]
    if not matches:
        raise KeyError(reference)
    return matches[-1]


def scan_records() -> tuple[list[JobRecord], list[str]]:
    """Every record in the store, oldest first, and a sentence for each one that cannot be
    read (skipped: one damaged record must not hide every other job)."""
    root = jobs_root()
    if not root.is_dir():
        return [], []
    records, damaged = [], []
    for child in sorted(root.iterdir()):
        path = child / RECORD
        if not os.path.lexists(path):
            continue  # a directory being made, or not a job's
        try:
            records.append(read_record(path))
        except DamagedRecord as exc:
            damaged.append(str(exc))
    return sorted(records, key=lambda r: r.created), damaged


def all_records() -> list[JobRecord]:
    """Every readable record in the store, oldest first (`scan_records` names the others)."""
    return scan_records()[0]


def sweeps_root() -> Path:
    return home() / "sweeps"


def save_sweep(sweep_id: str, data: dict[str, Any]) -> Path:
    return atomic_write_text(sweeps_root() / f"{sweep_id}.json", json.dumps(data, indent=2))


def load_sweep(sweep_id: str) -> dict[str, Any]:
    """The record of the sweep `sweep_id` (a name inside the store, never a path): KeyError
    when there is none, DamagedRecord naming the file when it cannot be read as one."""
    check_reference(sweep_id, "sweep")
    if not _store_name(sweep_id):
        raise KeyError(sweep_id)
    path = sweeps_root() / f"{sweep_id}.json"
    if not os.path.lexists(path):
        raise KeyError(sweep_id)
    try:
        data = read_bounded_object(path, MAX_STATE_BYTES, "the sweep record")
    except BoundedReadError as exc:
        raise DamagedRecord(f"damaged sweep record {exc}") from None
    problem = _sweep_problem(data)
    if problem is not None:
        raise DamagedRecord(f"damaged sweep record {path}: {problem}")
    return data


def _sweep_problem(data: dict[str, Any]) -> str | None:
    """What a sweep record lacks of what `report` reads, or None."""
    for name, kind in (("id", str), ("name", str), ("target", str), ("axes", list)):
        if not isinstance(data.get(name), kind):
            return f"{name} is missing or not a {kind.__name__}"
    points = data.get("points")
    if not isinstance(points, list):
        return "points is missing or not a list"
    for number, point in enumerate(points):
        if not (
            isinstance(point, dict)
            and isinstance(point.get("name"), str)
            and isinstance(point.get("values"), dict)
            and isinstance(point.get("job"), (str, type(None)))
            and isinstance(point.get("spec"), (dict, type(None)))
        ):
            return f"points[{number}] is not a point (name, values, job, spec)"
    return None


def run_dir(record: JobRecord) -> Path:
    """Where the job's trainer wrote metrics.jsonl and summary.json."""
    return Path(record.extra.get("run_dir") or record.directory)


def recorded_spec(record: JobRecord) -> dict[str, Any] | None:
    """The resolved spec a job was submitted with (JSON data), from its record or the spec.json
    beside it; None where neither holds it."""
    spec = record.extra.get("spec")
    if isinstance(spec, dict):
        return spec
    for directory in (record.directory, run_dir(record)):
        path = directory / "spec.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return None


def recorded_ranks(record: JobRecord) -> int | None:
    """How many ranks the job runs (nodes x GPUs per node of its recorded spec), or None."""
    spec = recorded_spec(record)
    try:
        cluster = spec["cluster"] if spec else None
        return int(cluster["nodes"]) * int(cluster["gpus_per_node"]) if cluster else None
    except (KeyError, TypeError, ValueError):
        return None
