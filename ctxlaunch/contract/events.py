"""The job's report to the launcher: one JSON object a line in <run dir>/events.jsonl.

The trainer appends what happened (it started, a step, a checkpoint, an evaluation, a stop
signal, an OOM, a failure, a re-planned layout) and the Slurm batch script appends a requeue
with its cause; `ctxlaunch status`
reads them back instead of parsing log text. The kinds and their fields are defined here once:
the writer, the reader and the batch script's printf line (built by `requeue_printf`) all
come from EVENT_FIELDS, so the format cannot drift between Python and shell.

Every line is {"event": <kind>, "time": <unix seconds>, <the kind's fields>}. Human log lines
stay as they are; these are for programs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxlaunch.contract.bounded import (
    MAX_EVENTS_BYTES,
    BoundedReadError,
    loads_bounded_json,
    read_bounded_lines,
)

EVENTS_FILE = "events.jsonl"

STARTED = "started"
STEP = "step"
CHECKPOINT = "checkpoint"
STOP_SIGNAL = "stop_signal"
REQUEUE = "requeue"
OOM = "oom"
FAILURE = "failure"
EVAL = "eval"
CHECKPOINT_SKIPPED = "checkpoint_skipped"
REPLANNED = "replanned"

EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    STARTED: ("restart", "world_size"),
    STEP: ("step", "loss"),
    CHECKPOINT: ("step", "path"),
    STOP_SIGNAL: ("step",),
    REQUEUE: ("restart", "cause", "exit"),
    OOM: ("rank", "step", "message", "phase", "figures"),
    FAILURE: ("rank", "cause"),
    EVAL: ("step", "loss"),
    CHECKPOINT_SKIPPED: ("step", "path", "reason"),
    REPLANNED: ("restart", "why", "from", "to", "step", "fault_step", "figures"),
}
"""Event kind -> its fields, in the order they are written. `restart` is the scheduler's
restart count of the run (0 for the first run); `exit` a process exit status. An OOM's `phase`
says where it struck (forward/backward, optimizer, checkpoint, evaluation, or the memory
limit's OOM killer) and its `figures` hold the allocator's (or the memory cgroup's) bytes. A
`replanned` event (training.heal) says `why` (oom, allocation), the layouts `from` and `to`
(each {"layout", "nodes", "gpus_per_node", "changes"}), the checkpoint `step` the run resumes
from, the `fault_step` it had reached, and the planner's `figures`."""

RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"
"""How often Slurm requeued the job so far; the trainer's `started` event carries it, so each
run's events are told apart (absent outside Slurm: restart 0)."""
LOCAL_RESTART_COUNT_ENV = "CTXLAUNCH_RESTART_COUNT"
"""The same count where ctxlaunch's own launcher restarts the job (the local launcher's runs
after an out-of-memory under training.heal)."""


def restart_count() -> int:
    """This run's restart count, for the `started` event (0 for the first run)."""
    try:
        return int(
            os.environ.get(RESTART_COUNT_ENV) or os.environ.get(LOCAL_RESTART_COUNT_ENV) or 0
        )
    except ValueError:
        return 0


@dataclass(frozen=True)
class Event:
    """One line of the events file."""

    kind: str
    time_seconds: float
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        """One of the event's fields (`default` when the line lacks it)."""
        return self.fields.get(name, default)


def events_path(run_dir: str | Path) -> Path:
    """The events file of a run directory."""
    return Path(run_dir) / EVENTS_FILE


def event_line(kind: str, **fields: Any) -> str:
    """The line (with its newline) that records one event; ValueError for an unknown kind or
    a field the kind does not have."""
    if kind not in EVENT_FIELDS:
        raise ValueError(f"unknown event kind {kind!r}; one of {', '.join(EVENT_FIELDS)}")
    unknown = set(fields) - set(EVENT_FIELDS[kind])
    if unknown:
        raise ValueError(f"event {kind!r} has no field(s) {', '.join(sorted(unknown))}")
    record: dict[str, Any] = {"event": kind, "time": round(time.time(), 3)}
    record.update((name, fields[name]) for name in EVENT_FIELDS[kind] if name in fields)
    return json.dumps(record, separators=(",", ":")) + "\n"


def append_event(run_dir: str | Path, kind: str, **fields: Any) -> bool:
    """Append one event to the run directory's events file; returns whether it was written.

    One write() on a file opened for appending, so lines from several ranks never interleave.
    A full or missing disk loses the event, never the job: the report must not crash it."""
    line = event_line(kind, **fields).encode()
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        handle = os.open(events_path(run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(handle, line)
        finally:
            os.close(handle)
    except OSError:
        return False
    return True


def parse_events(lines: list[str]) -> list[Event]:
    """The events in these lines, oldest first; a line that is not a complete event (half
    written when the job was killed, or foreign) is skipped."""
    records = []
    for line in lines:
        try:
            records.append(loads_bounded_json(line))
        except ValueError:
            continue
    return _events(records)


def _events(records: list[Any]) -> list[Event]:
    """The events among parsed lines: objects of a known kind (anything else is skipped)."""
    events = []
    for record in records:
        if not isinstance(record, dict) or record.get("event") not in EVENT_FIELDS:
            continue
        kind = record.pop("event")
        moment = record.pop("time", 0.0)
        events.append(
            Event(kind, float(moment) if isinstance(moment, (int, float)) else 0.0, record)
        )
    return events


def read_events(run_dir: str | Path) -> list[Event]:
    """The run directory's events, oldest first (none when it has no events file yet, or one
    that is no file: a FIFO, a directory): the file's last MAX_EVENTS_BYTES, read with bounds,
    so a job's log never hangs or exhausts the command that reads it."""
    try:
        lines = read_bounded_lines(events_path(run_dir), MAX_EVENTS_BYTES, "the events file")
    except BoundedReadError:
        return []
    return _events(lines)


def requeue_printf(events_file: str, restart_var: str, cause_var: str, exit_var: str) -> str:
    """The batch script's command that appends a `requeue` event: the same line as
    `event_line(REQUEUE, ...)`, from shell variables holding the run's restart count, the
    cause (plain words: no quote or backslash) and the exit status. `events_file` is a shell
    word for the file (already quoted). It never fails the script: a lost event must not stop
    the requeue."""
    variables = {"restart": restart_var, "cause": cause_var, "exit": exit_var}
    quoted = {"cause"}  # the JSON strings; the others are numbers
    names = EVENT_FIELDS[REQUEUE]
    body = ",".join(
        [f'"event":"{REQUEUE}"', '"time":%s']
        + [f'"{name}":' + ('"%s"' if name in quoted else "%s") for name in names]
    )
    arguments = " ".join(['"$(date +%s)"'] + [f'"${{{variables[name]}}}"' for name in names])
    # Single quotes: the format is literal to the shell; printf fills in the %s.
    return f"printf '{{{body}}}\\n' {arguments} 2>/dev/null >> {events_file} || true"
