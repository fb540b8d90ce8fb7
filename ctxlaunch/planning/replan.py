"""Re-planning a job that heals itself (training.heal): at the start of each run, the layout it
trains at on the allocation it got, from what the runs before it left in the heal log.

`decide` is the whole rule, pure (no I/O): the trainer's rank 0 calls it with the allocation
every rank agreed on and broadcasts the answer.

- The first run trains at the spec's own layout when it got the GPUs it asked for.
- After an out-of-memory the run re-plans on what it has: the measured peak over the predicted
  one raises the planner's margin for this job (predictions are multiplied by it before they
  are held against the memory), and every layout that ran out of memory on these GPUs is left
  out.
- On a changed allocation (fewer nodes after a node failure, or more again) it keeps its own
  degrees with the data-parallel degree that fills the GPUs when that is legal and fits, else
  re-plans; back on its own allocation it trains at its own layout again (it grows back).
- Otherwise it trains at the layout of the run before it.

The search (`search`) holds what the run must keep (model, sequence length, tokens per step,
and so the global batch and the data order; the CP sharding) and what `training.heal.may_change`
does not name, and varies the rest over the same degree options as `advise`: the fastest
layout the step-time model ranks among those that fit with the margin wins; among layouts it
cannot tell apart, the one that changes least.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from ctxlaunch.contract.hardware import GiB
from ctxlaunch.contract.heal_log import (
    KEPT,
    STARTED_AS_SPEC,
    HealHistory,
    LayoutEntry,
    layout_key,
)
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import JobSpec, layout_problems, resolve_state_engine
from ctxlaunch.contract.stages import balanced_stage_layers
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine, machine_for
from ctxlaunch.perf.memory import MemoryEstimate, estimate
from ctxlaunch.perf.steptime import StepTime, predict
from ctxlaunch.planning.advise import CHECKPOINTING, MICRO_BATCHES, ZERO_STAGES, degree_options


@dataclass(frozen=True)
class Allocation:
    """What a run got: its nodes, ranks per node, and the memory each rank may use (the
    device's, or on the CPU its share of the memory limit)."""

    nodes: int
    gpus_per_node: int
    capacity_bytes: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Candidate:
    """A layout on an allocation, with its predicted memory and step time."""

    layout: Layout
    memory: MemoryEstimate
    time: StepTime


@dataclass(frozen=True)
class Decision:
    """The layout a run trains at, and what to record about it."""

    spec: JobSpec
    """The spec this run trains: the submitted one with the layout and the allocation set."""
    entry: LayoutEntry
    """The heal log's entry for this run."""
    previous: LayoutEntry | None
    """The run before it (None for the first)."""
    replanned: bool
    """Whether the layout differs from the run before it (or, for a first run on another
    allocation, from the spec's own)."""
    why: str
    figures: dict[str, Any] = field(default_factory=dict)
    """The planner's figures: measured and predicted peaks, capacity, margin, the new
    layout's predicted peak and step time."""
    give_up: str | None = None
    """Why the job cannot go on (no layout fits, the re-plans are used up): the run ends."""


CHANGES_OF: dict[str, tuple[str, ...]] = {
    "cp": ("cp",),
    "cp_algorithm": ("cp_algorithm", "ulysses_degree"),
    "activation_checkpointing": ("activation_checkpointing",),
    "zero_stage": ("zero_stage",),
    "tp": ("tp",),
    "pp": ("pp", "virtual_stages", "stage_layers"),
    "micro_batch": ("micro_batch",),
    "ep": ("ep",),
}
"""training.heal.may_change names -> the Layout fields each lets a re-plan change."""


def layout_identity(layout: Layout, layers: int, nodes: int, gpus_per_node: int) -> dict[str, Any]:
    """What makes two layouts the same run on the same GPUs: the degrees, the pipeline split
    (balanced when unnamed), micro-batch, ZeRO stage with the engine that runs it,
    checkpointing and the allocation."""
    stages = layout.stage_layers or balanced_stage_layers(
        layers, layout.dims.pp * layout.dims.virtual_stages
    )
    return {
        "tp": layout.dims.tp,
        "pp": layout.dims.pp,
        "cp": layout.dims.cp,
        "dp": layout.dims.dp,
        "cp_algorithm": layout.dims.cp_algorithm if layout.dims.cp > 1 else "ring",
        "ulysses_degree": layout.dims.ulysses_degree if layout.dims.cp > 1 else 1,
        "virtual_stages": layout.dims.virtual_stages,
        "stage_layers": list(stages),
        "micro_batch": layout.micro_batch,
        "zero_stage": layout.zero_stage,
        # A mixture of experts' EP degree (named only where it splits the experts).
        **({"ep": layout.dims.ep} if layout.dims.ep > 1 else {}),
        "engine": resolve_state_engine(
            layout.engine,
            layout.zero_stage,
            tp=layout.dims.tp,
            pp=layout.dims.pp,
            ep=layout.dims.ep,
        ),
        "activation_checkpointing": layout.activation_checkpointing,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
    }


def describe(layout: Layout) -> str:
    """A layout in one line: "tp 1 pp 1 cp 2 ring dp 1, mb 1, ZeRO-0, checkpointing none"."""
    v = f" v{layout.dims.virtual_stages}" if layout.dims.virtual_stages > 1 else ""
    return (
        f"{layout.dims.describe()}{v}, mb {layout.micro_batch}, ZeRO-{layout.zero_stage}, "
        f"checkpointing {layout.activation_checkpointing}"
    )


def at_allocation(spec: JobSpec, allocation: Allocation) -> JobSpec:
    """`spec` on `allocation`'s nodes (not re-validated), one GPU per replica (the search sets
    the degrees), the global batch held, and the engine that keeps a healed job's checkpoints
    loadable at any layout: FSDP2 for any ZeRO stage a re-plan picks."""
    cluster = spec.cluster.model_copy(
        update={"nodes": allocation.nodes, "gpus_per_node": allocation.gpus_per_node}
    )
    parallel = spec.parallel.model_copy(
        update={
            "tp": 1,
            "pp": 1,
            "cp": 1,
            "ep": 1,
            "dp": None,
            "ulysses_degree": None,
            "ring_degree": None,
            "virtual_stages": 1,
            "stage_layers": None,
        }
    )
    training = spec.training.model_copy(
        update={
            "engine": "fsdp2",
            "micro_batch": 1,
            "grad_accum": None,
            "global_batch": spec.global_batch,
        }
    )
    return spec.model_copy(update={"cluster": cluster, "parallel": parallel, "training": training})


def spec_for(spec: JobSpec, layout: Layout, allocation: Allocation) -> JobSpec:
    """The submitted spec with `layout` on `allocation`, validated (SpecError where it is not
    legal: a bug here, since only legal layouts are chosen)."""
    return _with_changes(spec, layout.overrides(), allocation.nodes, allocation.gpus_per_node)


def _with_changes(
    spec: JobSpec, changes: dict[str, Any], nodes: int, gpus_per_node: int
) -> JobSpec:
    from ctxlaunch.contract.loader import apply_overrides, validate_spec

    changes = {**changes, "cluster.nodes": nodes, "cluster.gpus_per_node": gpus_per_node}
    data = apply_overrides(
        spec.model_dump(mode="json"), [f"{k}={json.dumps(v)}" for k, v in changes.items()]
    )
    return validate_spec(data, f"{spec.name} (re-planned)")


def layout_of(spec: JobSpec, entry: LayoutEntry) -> Layout:
    """The layout a run of the heal log trained at (its overrides applied to `spec`)."""
    return Layout.from_spec(_with_changes(spec, entry.changes, entry.nodes, entry.gpus_per_node))


def _fixed(own: Layout, may_change: list[str]) -> set[str]:
    """The Layout fields a re-plan must keep."""
    free = {name for change in may_change for name in CHANGES_OF.get(change, ())}
    return {name for names in CHANGES_OF.values() for name in names} - free


_DIMS_FIELDS = frozenset(f.name for f in dataclasses.fields(ParallelDims))


def _value(layout: Layout, name: str) -> Any:
    """A field of the layout by name: one of its degrees (its ParallelDims) or its own."""
    return getattr(layout.dims if name in _DIMS_FIELDS else layout, name)


def _keeps(layout: Layout, own: Layout, fixed: set[str]) -> bool:
    return all(_value(layout, name) == _value(own, name) for name in fixed)


def _changed_fields(layout: Layout, current: Layout) -> int:
    names = (
        "tp",
        "pp",
        "cp",
        "dp",
        "cp_algorithm",
        "micro_batch",
        "zero_stage",
        "activation_checkpointing",
        "virtual_stages",
        "ep",
    )
    return sum(1 for name in names if _value(layout, name) != _value(current, name))


def search(
    spec: JobSpec,
    allocation: Allocation,
    *,
    may_change: list[str],
    margin: float = 1.0,
    exclude: frozenset[str] = frozenset(),
    current: Layout | None = None,
    machine: Machine | None = None,
) -> tuple[Candidate | None, int]:
    """The fastest legal layout of `spec` on `allocation` that fits `capacity / margin` per
    rank, keeps what `may_change` does not name and is not in `exclude` (layout_key of
    layout_identity); with the number of layouts it weighed. Ties (the step-time model's four
    digits) go to the layout with the fewest changes from `current` (default the spec's)."""
    base = at_allocation(spec, allocation)
    own = Layout.from_spec(spec)
    current = current or own
    fixed = _fixed(own, may_change)
    machine = machine or machine_for(base, gpus_per_node=allocation.gpus_per_node)
    gpu = dataclasses.replace(
        base.cluster.gpu_info, memory_bytes=int(allocation.capacity_bytes / max(margin, 1.0))
    )
    global_batch = spec.global_batch
    model = spec.model
    best: tuple[tuple, Candidate] | None = None
    weighed = 0
    for degrees in degree_options(
        base, allocation.world_size, allocation.gpus_per_node, machine.nvlink_domain
    ):
        degrees = degrees.replace(engine="fsdp2")
        if not _keeps(degrees, own, fixed & {"tp", "pp", "cp", "cp_algorithm", "ulysses_degree"}):
            continue
        if layout_problems(degrees.apply_to(base)):
            continue
        micro_batches = MICRO_BATCHES if "micro_batch" not in fixed else (own.micro_batch,)
        virtual = {1} | ({own.dims.virtual_stages} if degrees.dims.pp == own.dims.pp else set())
        modes = (
            CHECKPOINTING
            if "activation_checkpointing" not in fixed
            else (own.activation_checkpointing,)
        )
        zeros = ZERO_STAGES if "zero_stage" not in fixed else (own.zero_stage,)
        for micro_batch, virtual_stages in itertools.product(micro_batches, sorted(virtual)):
            if global_batch % (micro_batch * degrees.dims.dp):
                continue
            layout = degrees.with_dims(virtual_stages=virtual_stages).replace(
                micro_batch=micro_batch,
                grad_accum=global_batch // (micro_batch * degrees.dims.dp),
                stage_layers=own.stage_layers
                if virtual_stages == own.dims.virtual_stages and degrees.dims.pp == own.dims.pp
                else (),
            )
            if (micro_batch > 1 or virtual_stages > 1) and layout_problems(layout.apply_to(base)):
                continue
            for mode, zero_stage in itertools.product(modes, zeros):
                candidate_layout = layout.replace(
                    activation_checkpointing=mode, zero_stage=zero_stage
                )
                identity = layout_identity(
                    candidate_layout, model.layers, allocation.nodes, allocation.gpus_per_node
                )
                if layout_key(identity) in exclude:
                    continue
                memory = estimate(model, candidate_layout, gpu)
                weighed += 1
                if not memory.fits:
                    continue
                time = predict(model, candidate_layout, machine)
                key = (
                    float(f"{time.step_seconds:.4g}"),
                    _changed_fields(candidate_layout, current),
                    candidate_layout.dims.tp * candidate_layout.dims.pp * candidate_layout.dims.cp,
                    zero_stage,
                    micro_batch,
                    virtual_stages,
                    memory.total,
                )
                if best is None or key < best[0]:
                    best = (key, Candidate(candidate_layout, memory, time))
    return (best[1] if best else None), weighed


def own_layout_at(spec: JobSpec, allocation: Allocation) -> Layout | None:
    """The spec's own layout on `allocation` with the data-parallel degree that fills it (the
    global batch held), where that is legal; None where it is not."""
    own = Layout.from_spec(spec)
    per_replica = own.dims.ranks_per_replica
    if allocation.world_size % per_replica:
        return None
    dp = allocation.world_size // per_replica
    if spec.global_batch % (own.micro_batch * dp):
        return None
    layout = own.with_dims(dp=dp).replace(grad_accum=spec.global_batch // (own.micro_batch * dp))
    if layout_problems(layout.apply_to(at_allocation(spec, allocation))):
        return None
    return layout


def margin_after(previous: LayoutEntry, ooms: list[Any]) -> tuple[float, int]:
    """(the planner's new margin for this job, the measured peak per rank) after the OOMs of
    the run `previous` started: the measured over the predicted peak where it beat the
    prediction, never below the margin so far. A rank the OOM killer ended measured at least
    its share of the limit."""
    measured = max(
        entry.measured_peak_bytes
        if entry.measured_peak_bytes is not None
        else max(entry.capacity_bytes or 0, previous.capacity_bytes)
        for entry in ooms
    )
    ratio = measured / previous.predicted_peak_bytes if previous.predicted_peak_bytes else 1.0
    return max(previous.margin, ratio, 1.0), measured


def _entry(
    why: str,
    spec: JobSpec,
    layout: Layout,
    allocation: Allocation,
    memory: MemoryEstimate,
    margin: float,
    step: int,
    restart: int,
) -> LayoutEntry:
    return LayoutEntry(
        why=why,
        changes=layout.overrides(),
        identity=layout_identity(
            layout, spec.model.layers, allocation.nodes, allocation.gpus_per_node
        ),
        layout=describe(layout),
        nodes=allocation.nodes,
        gpus_per_node=allocation.gpus_per_node,
        capacity_bytes=allocation.capacity_bytes,
        margin=round(margin, 4),
        predicted_peak_bytes=memory.total,
        step=step,
        restart=restart,
    )


@dataclass
class _Start:
    """One start's inputs, for the cases of `decide`."""

    spec: JobSpec
    allocation: Allocation
    history: HealHistory
    step: int
    restart: int
    machine: Machine | None

    def memory(self, layout: Layout) -> MemoryEstimate:
        gpu = dataclasses.replace(
            self.spec.cluster.gpu_info, memory_bytes=self.allocation.capacity_bytes
        )
        return estimate(self.spec.model, layout, gpu)

    def decision(
        self,
        why: str,
        layout: Layout,
        margin: float,
        figures: dict[str, Any] | None = None,
        memory: MemoryEstimate | None = None,
    ) -> Decision:
        memory = memory or self.memory(layout)
        entry = _entry(
            why, self.spec, layout, self.allocation, memory, margin, self.step, self.restart
        )
        previous = self.history.last
        before = previous.key if previous else self._own_key()
        return Decision(
            spec=spec_for(self.spec, layout, self.allocation),
            entry=entry,
            previous=previous,
            replanned=entry.key != before,
            why=why,
            figures={
                "capacity_bytes": self.allocation.capacity_bytes,
                "margin": round(margin, 4),
                "predicted_peak_bytes": memory.total,
                **(figures or {}),
            },
        )

    def _own_key(self) -> str:
        s = self.spec
        return layout_key(
            layout_identity(
                Layout.from_spec(s), s.model.layers, s.cluster.nodes, s.cluster.gpus_per_node
            )
        )

    def give_up(self, why: str, message: str, figures: dict[str, Any]) -> Decision:
        own = Layout.from_spec(self.spec)
        return Decision(
            spec=self.spec,
            entry=_entry(
                why,
                self.spec,
                own,
                self.allocation,
                self.memory(own),
                1.0,
                self.step,
                self.restart,
            ),
            previous=self.history.last,
            replanned=False,
            why=why,
            figures=figures,
            give_up=message,
        )

    def replan(self, why: str, margin: float, figures: dict[str, Any]) -> Decision:
        heal = self.spec.training.heal
        if self.history.replans >= heal.max_replans:
            return self.give_up(
                why,
                f"training.heal.max_replans ({heal.max_replans}) re-plans are used up",
                figures,
            )
        last = self.history.last
        current = layout_of(self.spec, last) if last is not None else None
        found, weighed = search(
            self.spec,
            self.allocation,
            may_change=list(heal.may_change),
            margin=margin,
            exclude=frozenset(self.history.failed_keys()),
            current=current,
            machine=self.machine,
        )
        figures = {**figures, "layouts_weighed": weighed}
        if found is None:
            return self.give_up(
                why,
                f"no layout of this job fits {self.allocation.nodes} x "
                f"{self.allocation.gpus_per_node} ranks with "
                f"{self.allocation.capacity_bytes / GiB:.2f} GiB each at margin {margin:.2f} "
                f"(training.heal.may_change: {', '.join(heal.may_change) or 'nothing'}; "
                f"{weighed} layouts weighed, the ones that ran out of memory left out)",
                figures,
            )
        figures["predicted_step_seconds"] = found.time.step_seconds
        return self.decision(why, found.layout, margin, figures, found.memory)


def decide(
    spec: JobSpec,
    allocation: Allocation,
    history: HealHistory,
    *,
    step: int = 0,
    restart: int = 0,
    machine: Machine | None = None,
) -> Decision:
    """The layout this run of `spec` (the submitted spec) trains at on `allocation`, given the
    heal log's `history`; `step` is the checkpoint it resumes from. See the module docstring."""
    start = _Start(spec, allocation, history, step, restart, machine)
    own = Layout.from_spec(spec)
    on_own_allocation = (allocation.nodes, allocation.gpus_per_node) == (
        spec.cluster.nodes,
        spec.cluster.gpus_per_node,
    )
    last = history.last
    failed = history.failed_keys()
    pending = history.pending_ooms
    if last is not None and pending and spec.training.heal.on_oom == "replan":
        margin, measured = margin_after(last, pending)
        figures = {
            "measured_peak_bytes": measured,
            "previous_predicted_peak_bytes": last.predicted_peak_bytes,
            "previous_capacity_bytes": last.capacity_bytes,
            "phase": pending[0].phase,
            "source": pending[0].source,
        }
        return start.replan("oom", margin, figures)
    margin = last.margin if last is not None else 1.0
    if last is not None and (last.nodes, last.gpus_per_node) == (
        allocation.nodes,
        allocation.gpus_per_node,
    ):
        return start.decision(KEPT, layout_of(spec, last), margin)
    if on_own_allocation and last is None:
        return start.decision(STARTED_AS_SPEC, own, margin)
    if not spec.training.heal.elastic:
        return start.give_up(
            "allocation",
            f"the job got {allocation.nodes} x {allocation.gpus_per_node} ranks but asks for "
            f"{spec.cluster.nodes} x {spec.cluster.gpus_per_node} and "
            "training.heal.on_allocation_change is wait",
            {},
        )
    adapted = own_layout_at(spec, allocation)
    if adapted is not None:
        key = layout_key(
            layout_identity(adapted, spec.model.layers, allocation.nodes, allocation.gpus_per_node)
        )
        memory = start.memory(adapted)
        if key not in failed and memory.total * margin <= allocation.capacity_bytes:
            return start.decision(
                "allocation", adapted, margin, {"predicted_peak_bytes": memory.total}, memory
            )
    return start.replan("allocation", margin, {})
