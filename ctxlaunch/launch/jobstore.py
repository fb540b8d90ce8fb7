"""The local record of submitted jobs: one directory per job under $CTXLAUNCH_HOME/jobs
(default ~/.ctxlaunch/jobs) holding the resolved spec, the submitted artifact, the backend's
ids and, for local jobs, the run's logs and metrics."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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


def save(record: JobRecord) -> Path:
    record.directory.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(record.directory / RECORD, json.dumps(asdict(record), indent=2))


def load(job_id: str) -> JobRecord:
    path = jobs_root() / job_id / RECORD
    if not path.is_file():
        raise KeyError(job_id)
    return JobRecord(**json.loads(path.read_text()))


def find(reference: str) -> JobRecord:
    """A job by its ctxlaunch id or by the scheduler's id (e.g. the Slurm job id)."""
    try:
        return load(reference)
    except KeyError:
        pass
    matches = [r for r in all_records() if r.backend_id == reference]
    if not matches:
        raise KeyError(reference)
    return matches[-1]


def all_records() -> list[JobRecord]:
    root = jobs_root()
    if not root.is_dir():
        return []
    records = []
    for child in root.iterdir():
        try:
            records.append(load(child.name))
        except (KeyError, json.JSONDecodeError, TypeError):
            continue
    return sorted(records, key=lambda r: r.created)


def sweeps_root() -> Path:
    return home() / "sweeps"


def save_sweep(sweep_id: str, data: dict[str, Any]) -> Path:
    return atomic_write_text(sweeps_root() / f"{sweep_id}.json", json.dumps(data, indent=2))


def load_sweep(sweep_id: str) -> dict[str, Any]:
    path = sweeps_root() / f"{sweep_id}.json"
    if not path.is_file():
        raise KeyError(sweep_id)
    return json.loads(path.read_text())


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
