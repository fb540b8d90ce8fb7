"""A self-healing job's memory across its runs: <training.checkpoint.dir>/heal.jsonl.

The checkpoint directory is the one place every run of a job sees, whatever restarted it (a
Slurm requeue, a replaced pod, the local launcher): a re-planned run resumes from it, so what
the next run must know about the last one lives beside it, one JSON object a line:

    {"entry": "layout", ...}   a run's start: the layout it trains at, on what allocation, the
                               planner's figures, and why (start, resume, oom, allocation)
    {"entry": "oom", ...}      an out-of-memory of the run since the last layout entry: who
                               saw it (the trainer's allocator, the memory cgroup's OOM killer
                               as the pod entry or the Slurm batch script found it), where, and
                               the bytes measured

Whoever sees an OOM appends it (several ranks may: one write() on a file opened for appending
never interleaves); rank 0 alone appends the layout entry at each start. `read_heal_log` folds
the lines into a `HealHistory`: the last layout, the OOMs since, the layouts that ran out of
memory (never chosen again), and how many re-plans the job has had.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEAL_LOG = "heal.jsonl"
HEALING_KEY = "ctxlaunch_healing"
"""The key of a pod's termination message that holds its job's re-plans in words (the pod
entry writes it, the Kubernetes backend's status reads it)."""
LAYOUT = "layout"
OOM = "oom"

STARTED_AS_SPEC = "start"
"""The first run, at the spec's own layout on the spec's own allocation."""
KEPT = "resume"
"""A later run at the layout of the run before it (nothing to heal)."""
REPLAN_CAUSES = ("oom", "allocation")
"""Why a run's layout changed: an out-of-memory, or a changed allocation (fewer nodes, or the
nodes back)."""


def heal_log_path(checkpoint_dir: str | Path) -> Path:
    """The heal log of a job whose checkpoints go to `checkpoint_dir`."""
    return Path(checkpoint_dir) / HEAL_LOG


def _append(checkpoint_dir: str | Path, record: dict[str, Any]) -> bool:
    """Append one line; returns whether it was written (a full disk loses the entry, never the
    job: the next run then re-plans with less to go on)."""
    line = (json.dumps({**record, "time": round(time.time(), 3)}, sort_keys=True) + "\n").encode()
    try:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        handle = os.open(
            heal_log_path(checkpoint_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
        )
        try:
            os.write(handle, line)
        finally:
            os.close(handle)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class OomEntry:
    """An out-of-memory of one run."""

    source: str
    """allocator (the trainer caught torch's OutOfMemoryError), cgroup (the kernel's OOM killer
    under a memory limit, found by the pod entry or the Slurm batch script), or injected."""
    phase: str
    """Where it struck: forward/backward, optimizer, checkpoint, evaluation, or start; for the
    OOM killer, killed (the rank's own phase is lost with it)."""
    step: int | None = None
    """The step being trained (the last logged one for a killed rank), if known."""
    rank: int | None = None
    measured_peak_bytes: int | None = None
    """What the rank needed at the OOM, per rank: the allocator's reserved bytes plus the
    request that failed; for a killed rank, its share of the memory limit (a lower bound)."""
    capacity_bytes: int | None = None
    """The memory the rank had (the device's, or its share of the limit)."""
    message: str = ""
    time_seconds: float = 0.0


@dataclass(frozen=True)
class LayoutEntry:
    """A run's start: the layout it trains at."""

    why: str
    """start, resume, oom or allocation (REPLAN_CAUSES: the layout changed)."""
    changes: dict[str, Any]
    """The `--set` overrides of the layout (perf.layout.Layout.overrides)."""
    identity: dict[str, Any]
    """What makes two layouts the same run on the same GPUs (planning.replan.layout_identity):
    degrees, pipeline split, micro-batch, ZeRO stage and engine, checkpointing, nodes."""
    layout: str
    """The layout in words ("tp 1 pp 1 cp 2 ring dp 1, mb 1, ZeRO-0, checkpointing none")."""
    nodes: int
    gpus_per_node: int
    capacity_bytes: int = 0
    """Memory per rank the run had (the device's, or its share of the limit)."""
    margin: float = 1.0
    """The planner's margin for this job: predicted peaks are multiplied by it before they are
    held against the capacity (raised by each OOM whose measured peak beat the prediction)."""
    predicted_peak_bytes: int = 0
    step: int = 0
    """The checkpoint step the run resumed from."""
    restart: int = 0
    time_seconds: float = 0.0

    @property
    def key(self) -> str:
        """What identifies the layout on its allocation (two runs at the same key ran the same
        layout on the same GPUs)."""
        return layout_key(self.identity)


def layout_key(identity: dict[str, Any]) -> str:
    """A layout's identity as one comparable string."""
    return json.dumps(identity, sort_keys=True)


def record_oom(checkpoint_dir: str | Path, entry: OomEntry) -> bool:
    """Append an out-of-memory of the current run; returns whether it was written."""
    fields = {k: v for k, v in vars(entry).items() if k != "time_seconds"}
    return _append(checkpoint_dir, {"entry": OOM, **fields})


def record_layout(checkpoint_dir: str | Path, entry: LayoutEntry) -> bool:
    """Append a run's layout (rank 0, at its start); returns whether it was written."""
    fields = {k: v for k, v in vars(entry).items() if k != "time_seconds"}
    return _append(checkpoint_dir, {"entry": LAYOUT, **fields})


def _build(kind: type, record: dict[str, Any]) -> Any:
    import dataclasses

    names = {f.name for f in dataclasses.fields(kind) if f.name != "time_seconds"}
    moment = record.get("time", 0.0)
    return kind(
        **{k: v for k, v in record.items() if k in names},
        time_seconds=float(moment) if isinstance(moment, (int, float)) else 0.0,
    )


@dataclass
class HealHistory:
    """What the heal log says, oldest first."""

    layouts: list[LayoutEntry] = field(default_factory=list)
    ooms: list[tuple[int, OomEntry]] = field(default_factory=list)
    """Each OOM with the number of layout entries before it (the run it happened in is the
    layout entry at that index minus one; -1 before any layout entry)."""

    @property
    def last(self) -> LayoutEntry | None:
        """The layout of the newest run, if any run has started."""
        return self.layouts[-1] if self.layouts else None

    @property
    def pending_ooms(self) -> list[OomEntry]:
        """The OOMs of the newest run (since its layout entry): what the next run heals."""
        return [entry for count, entry in self.ooms if count == len(self.layouts)]

    @property
    def replans(self) -> int:
        """How often a run's layout changed (training.heal.max_replans bounds it)."""
        return sum(1 for entry in self.layouts if entry.why in REPLAN_CAUSES)

    def failed_keys(self) -> set[str]:
        """The layouts (on their allocations) a run of which ran out of memory."""
        return {self.layouts[count - 1].key for count, _ in self.ooms if count >= 1}


def parse_heal_log(lines: list[str]) -> HealHistory:
    """The history in these lines; a line that is not a complete entry (cut when a node died)
    is skipped."""
    history = HealHistory()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        kind = record.pop("entry", None)
        try:
            if kind == LAYOUT:
                history.layouts.append(_build(LayoutEntry, record))
            elif kind == OOM:
                history.ooms.append((len(history.layouts), _build(OomEntry, record)))
        except TypeError:  # a required field missing
            continue
    return history


def read_heal_log(checkpoint_dir: str | Path | None) -> HealHistory:
    """The heal log of the job whose checkpoints go to `checkpoint_dir` (empty when there is
    none yet)."""
    if checkpoint_dir is None:
        return HealHistory()
    try:
        text = heal_log_path(checkpoint_dir).read_text(errors="replace")
    except OSError:
        return HealHistory()
    return parse_heal_log(text.splitlines())


# --------------------------------------------------------------------------------------------
# a re-plan in words (the trainer's log line, `status`, `report`)
# --------------------------------------------------------------------------------------------
def _layout_words(side: dict[str, Any]) -> dict[str, str]:
    """A side of a `replanned` event ({"changes", "nodes", ...}) as labelled phrases."""
    changes = side.get("changes") or {}
    nodes = side.get("nodes")
    cp = changes.get("parallel.cp")
    algorithm = changes.get("parallel.cp_algorithm")
    cp_words = f"cp {cp}"
    if cp and cp > 1 and algorithm:
        cp_words += f" {algorithm}"
        if algorithm == "hybrid":
            cp_words += f" u{changes.get('parallel.ulysses_degree')}"
    words = {
        "nodes": f"{nodes} node{'s' if nodes != 1 else ''}" if nodes else "",
        "cp": cp_words if cp else "",
        "tp": f"tp {changes.get('parallel.tp')}",
        "pp": f"pp {changes.get('parallel.pp')}",
        "dp": f"dp {changes.get('parallel.dp')}",
        "mb": f"micro-batch {changes.get('training.micro_batch')}",
        "zero": f"ZeRO-{changes.get('training.zero_stage')}",
        "checkpointing": f"checkpointing {changes.get('training.activation_checkpointing')}",
    }
    return {k: v for k, v in words.items() if v and "None" not in v}


def describe_change(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, str]:
    """The two sides of a re-plan, each in the words that differ ("cp 4, checkpointing none",
    "cp 8, checkpointing selective"); the CP degree where nothing else is told."""
    a, b = _layout_words(before), _layout_words(after)
    keys = [k for k in b if a.get(k) != b.get(k)] or ["cp"]
    return (
        ", ".join(a[k] for k in keys if k in a) or "its own layout",
        ", ".join(b[k] for k in keys if k in b),
    )


def describe_replan(fields: dict[str, Any]) -> str:
    """A `replanned` event's fields in one line: "OOM at step 412 with cp 4, checkpointing
    none; resumed at step 400 with cp 8, checkpointing selective"."""
    before, after = fields.get("from") or {}, fields.get("to") or {}
    was, now = describe_change(before, after)
    why = fields.get("why")
    figures = fields.get("figures") or {}
    if why == "oom":
        phase = figures.get("phase")
        cause = "OOM" + (f" ({phase})" if phase and phase != "killed" else "")
        if figures.get("source") == "cgroup":
            cause = "OOM (killed at the memory limit)"
    elif why == "allocation":
        got, had = after.get("nodes"), before.get("nodes")
        if got and had and got > had:
            cause = f"allocation grown back to {got} nodes from {had}"
        elif got and had:
            cause = f"allocation of {got} node{'s' if got != 1 else ''} instead of {had}"
        else:
            cause = "changed allocation"
    else:
        cause = str(why)
    fault = fields.get("fault_step")
    at = f" at step {fault}" if fault is not None else ""
    return f"{cause}{at} with {was}; resumed at step {fields.get('step', 0)} with {now}"


def restarts_for_oom(checkpoint_dir: str | Path | None, max_replans: int) -> bool:
    """Whether a job whose run just ended out of memory is to run again (training.heal
    on_oom: replan): the OOM is in the heal log for the next run to re-plan from, and re-plans
    remain. The launchers (the local one, the pod entry, the Slurm batch script) ask this."""
    history = read_heal_log(checkpoint_dir)
    return bool(history.pending_ooms) and history.replans < max_replans


def _side(entry: LayoutEntry | None) -> dict[str, Any]:
    if entry is None:
        return {}
    return {
        "layout": entry.layout,
        "nodes": entry.nodes,
        "gpus_per_node": entry.gpus_per_node,
        "changes": entry.changes,
    }


def replan_stories(history: HealHistory) -> list[str]:
    """Each re-plan in the heal log in words, oldest first (as `describe_replan` tells a
    `replanned` event): where a launcher keeps no events across restarts (a replaced pod), the
    heal log beside the checkpoints still has the whole story."""
    stories = []
    for index, entry in enumerate(history.layouts):
        if entry.why not in REPLAN_CAUSES:
            continue
        ooms = [oom for count, oom in history.ooms if count == index]
        figures = {"phase": ooms[0].phase, "source": ooms[0].source} if ooms else {}
        stories.append(
            describe_replan(
                {
                    "why": entry.why,
                    "from": _side(history.layouts[index - 1] if index else None),
                    "to": _side(entry),
                    "step": entry.step,
                    "fault_step": next((o.step for o in ooms if o.step is not None), None),
                    "figures": figures,
                }
            )
        )
    return stories
