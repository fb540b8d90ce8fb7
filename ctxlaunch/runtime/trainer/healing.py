"""A job that heals itself (training.heal), on the trainer's side: every rank agrees, at the
start of each run, on the layout it trains at; an out-of-memory is recorded where it strikes.

At the start (`settle`), after the ranks joined their process group and before anything is
built: the ranks agree on the memory each may use (the smallest any of them reads: the device's,
or its share of the memory limit), rank 0 reads the heal log beside the checkpoints and asks the
planner (`planning.replan.decide`), and broadcasts the answer; every rank then builds the same
layout. Rank 0 appends the run to the heal log, and when the layout changed, a `replanned`
event to the run's events and a line to the log.

On an out-of-memory (`record_oom`), torch's OutOfMemoryError caught where the step raised it:
the phase it struck in (forward/backward, optimizer, checkpoint, evaluation) and the
allocator's figures go to the `oom` event, and with `on_oom: replan` to the heal log, for the
next run. The rank cannot checkpoint: its peers may be waiting in a collective it will never
join, and a collective with them could pair with the wrong one. The next run resumes from the
newest committed checkpoint, losing at most the steps since it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxlaunch.contract import events, exitcodes
from ctxlaunch.contract.heal_log import (
    OomEntry,
    describe_replan,
    read_heal_log,
    record_layout,
    record_oom,
)
from ctxlaunch.runtime.parallel.rank_setup import SetupError

if TYPE_CHECKING:
    import torch

    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.planning.replan import Decision
    from ctxlaunch.runtime.parallel.distenv import DistEnv


def check_allocation(spec: JobSpec, denv: DistEnv) -> None:
    """A job that may run on a changed allocation (on_allocation_change: replan) accepts any
    whole number of its nodes from heal.min_nodes to cluster.nodes; SetupError otherwise."""
    per_node = spec.cluster.gpus_per_node
    fewest = spec.training.heal.fewest_nodes(spec.cluster.nodes)
    nodes, rest = divmod(denv.world_size, per_node)
    if rest or not fewest <= nodes <= spec.cluster.nodes:
        raise SetupError(
            f"the launcher started {denv.world_size} ranks: training.heal accepts "
            f"{fewest} to {spec.cluster.nodes} nodes of {per_node} ranks "
            f"({fewest * per_node} to {spec.cluster.nodes * per_node} ranks)"
        )


@dataclass(frozen=True)
class Settled:
    """The outcome of `settle`: the spec to train, or the status to exit with."""

    spec: JobSpec
    decision: Decision | None = None
    exit_code: int | None = None
    capacity_bytes: int = 0


def rank_capacity_bytes(spec: JobSpec, device: torch.device, local_ranks: int) -> int:
    """The memory this rank may use: the device's (CUDA), else its share of the memory limit
    the node's ranks live under (runtime.allocation)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    from ctxlaunch.runtime.allocation import cpu_rank_capacity_bytes

    return cpu_rank_capacity_bytes(local_ranks)[0]


def _agreed_minimum(value: int, device: torch.device) -> int:
    """The smallest `value` over every rank (one all-reduce)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def _broadcast(payload: Any, device: torch.device) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def last_logged_step(run_dir: Path) -> int | None:
    """The newest `step` event of the run directory (the step the run before reached)."""
    steps = [e.get("step") for e in events.read_events(run_dir) if e.kind == events.STEP]
    return int(steps[-1]) if steps else None


def _side(entry: Any, spec: JobSpec) -> dict[str, Any]:
    """One side of a `replanned` event: a heal-log layout entry, else the spec's own."""
    if entry is not None:
        return {
            "layout": entry.layout,
            "nodes": entry.nodes,
            "gpus_per_node": entry.gpus_per_node,
            "changes": entry.changes,
        }
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.planning.replan import describe

    own = Layout.from_spec(spec)
    return {
        "layout": describe(own),
        "nodes": spec.cluster.nodes,
        "gpus_per_node": spec.cluster.gpus_per_node,
        "changes": own.overrides(),
    }


def _decide(spec: JobSpec, denv: DistEnv, capacity: int, run_dir: Path) -> dict[str, Any]:
    """Rank 0's part: the planner's decision as a payload every rank can rebuild."""
    from ctxlaunch.planning.replan import Allocation, decide
    from ctxlaunch.runtime.checkpointing import checkpoint

    directory = spec.training.checkpoint.dir
    allocation = Allocation(
        nodes=denv.world_size // spec.cluster.gpus_per_node,
        gpus_per_node=spec.cluster.gpus_per_node,
        capacity_bytes=capacity,
    )
    history = read_heal_log(directory)
    step = checkpoint.latest_step(directory) or 0
    decision = decide(spec, allocation, history, step=step, restart=events.restart_count())
    pending = history.pending_ooms
    fault_step = next((e.step for e in pending if e.step is not None), None)
    if fault_step is None:
        fault_step = last_logged_step(run_dir)
    return {
        "spec": decision.spec.model_dump(mode="json"),
        "give_up": decision.give_up,
        "oom": bool(pending),
        "decision": decision,
        "fault_step": fault_step,
    }


def settle(
    spec: JobSpec,
    denv: DistEnv,
    device: torch.device,
    run_dir: Path,
    log: Callable[[str], None],
) -> Settled:
    """The layout this run trains at, agreed by every rank (see the module docstring). Without
    training.heal, the spec as it is."""
    if not spec.training.heal.enabled:
        return Settled(spec)
    import os

    from ctxlaunch.contract.loader import validate_spec

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or spec.cluster.gpus_per_node)
    capacity = _agreed_minimum(rank_capacity_bytes(spec, device, local_ranks), device)
    payload: dict[str, Any] | None = None
    if denv.rank == 0:
        try:
            payload = _decide(spec, denv, capacity, run_dir)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not hang
            payload = {"error": f"re-planning failed: {type(exc).__name__}: {exc}"}
    shared = _broadcast(
        None if payload is None else {k: v for k, v in payload.items() if k != "decision"},
        device,
    )
    failure = shared.get("error") or shared.get("give_up")
    if failure:
        code = exitcodes.OOM if shared.get("oom") else exitcodes.FAILED
        if denv.rank == 0:
            log(f"ctxlaunch: error: training.heal cannot go on: {failure}")
            events.append_event(
                run_dir, events.FAILURE, rank=0, cause=f"training.heal cannot go on: {failure}"
            )
        return Settled(spec, exit_code=code, capacity_bytes=capacity)
    healed = validate_spec(shared["spec"], f"{spec.name} (agreed layout)")
    decision: Decision | None = payload.get("decision") if payload else None
    if denv.rank == 0 and decision is not None:
        _announce(spec, decision, shared.get("fault_step"), run_dir, log)
    return Settled(healed, decision, capacity_bytes=capacity)


def _announce(
    spec: JobSpec, decision: Decision, fault_step: int | None, run_dir: Path, log: Callable
) -> None:
    """Rank 0: the run's heal-log entry, and for a changed layout its event and log line."""
    record_layout(spec.training.checkpoint.dir or ".", decision.entry)
    if not decision.replanned:
        return
    fields = {
        "restart": events.restart_count(),
        "why": decision.why,
        "from": _side(decision.previous, spec),
        "to": _side(decision.entry, spec),
        "step": decision.entry.step,
        "fault_step": fault_step,
        "figures": decision.figures,
    }
    events.append_event(run_dir, events.REPLANNED, **fields)
    figures = decision.figures
    log(
        f"ctxlaunch: healed: {describe_replan(fields)} "
        f"(now {decision.entry.layout} on {decision.entry.nodes} x "
        f"{decision.entry.gpus_per_node}; predicted {figures['predicted_peak_bytes'] / 2**30:.2f}"
        f" GiB per rank of {figures['capacity_bytes'] / 2**30:.2f} GiB at margin "
        f"{figures['margin']:.2f})"
    )


# --------------------------------------------------------------------------------------------
# an out-of-memory
# --------------------------------------------------------------------------------------------
_REQUESTED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(message: str) -> int:
    """The allocation that failed, as CUDA's caching allocator words it ("Tried to allocate
    2.00 GiB"); 0 where the message does not say."""
    found = _REQUESTED.search(message)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0


def oom_figures(device: torch.device, message: str, capacity_bytes: int) -> dict[str, int]:
    """The allocator's figures at an out-of-memory: allocated, reserved and peak bytes, the
    request that failed, the device's capacity, and the rank's measured need (reserved plus
    the request: what the allocator would have had to hold). On the CPU (an injected OOM) the
    process's peak resident memory stands for all of them."""
    import torch

    from ctxlaunch.runtime.records import peak_memory_bytes

    requested = requested_bytes(message)
    if device.type == "cuda":
        reserved = int(torch.cuda.memory_reserved(device))
        return {
            "allocated_bytes": int(torch.cuda.memory_allocated(device)),
            "reserved_bytes": reserved,
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "requested_bytes": requested,
            "capacity_bytes": capacity_bytes
            or int(torch.cuda.get_device_properties(device).total_memory),
            "measured_peak_bytes": reserved + requested,
        }
    peak = peak_memory_bytes(device)
    return {
        "peak_rss_bytes": peak,
        "requested_bytes": requested,
        "capacity_bytes": capacity_bytes,
        "measured_peak_bytes": peak + requested,
    }


def record_out_of_memory(
    spec: JobSpec,
    *,
    rank: int,
    step: int,
    phase: str,
    message: str,
    device: torch.device,
    capacity_bytes: int,
    run_dir: Path,
    injected: bool,
) -> None:
    """The `oom` event of this rank (phase and figures), and with on_oom: replan its entry in
    the heal log for the next run."""
    figures = oom_figures(device, message, capacity_bytes)
    events.append_event(
        run_dir, events.OOM, rank=rank, step=step, message=message, phase=phase, figures=figures
    )
    heal = spec.training.heal
    directory = spec.training.checkpoint.dir
    if heal.on_oom != "replan" or directory is None:
        return
    record_oom(
        directory,
        OomEntry(
            source="injected" if injected else "allocator",
            phase=phase,
            step=step,
            rank=rank,
            measured_peak_bytes=figures["measured_peak_bytes"],
            capacity_bytes=figures["capacity_bytes"] or None,
            message=message[:500],
        ),
    )
