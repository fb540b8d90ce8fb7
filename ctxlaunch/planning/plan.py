"""`ctxlaunch plan`: memory against capacity, the CP degrees that fit, and model FLOPs.

Combines the memory model (memory.py), the FLOPs model (flops.py) and the layout rules
(spec.cp_problems) into one report, as a table for people and a dict for programs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxlaunch.contract.hardware import GiB
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import JobSpec, cp_problems, problem_message
from ctxlaunch.perf import moecost
from ctxlaunch.perf.accounting import Accounting, account
from ctxlaunch.perf.activations import ATTENTION_TILE_TOKENS
from ctxlaunch.perf.flops import CONVENTIONS, count_params, flops_per_token
from ctxlaunch.perf.hostmemory import HostEstimate, HostLimit, host_estimate
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine, machine_for
from ctxlaunch.perf.memory import MemoryEstimate, estimate, fits_with_host, longest_sequence
from ctxlaunch.perf.modelstates import stage_expert_params, state_bytes
from ctxlaunch.perf.peakphases import Phase, peak_phases
from ctxlaunch.perf.steptime import predict

MAX_CP = 256


@dataclass(frozen=True)
class CpOption:
    """The job at another CP degree, with TP, PP, EP and DP held."""

    dims: ParallelDims
    """The job's degrees at this CP degree."""
    nodes: int
    legal: bool
    """Whether the spec's CP algorithm and layout allow this degree at the spec's seq_len."""
    reason: str | None
    estimate: MemoryEstimate
    longest_seq_len: int
    """The longest sequence that fits at this degree (legal for the layout)."""
    offload_seq_len: int = 0
    """The longest sequence that fits at this degree with the offload recipe
    (`offload_layout`), device and host memory both; 0 where it reaches no further."""
    offload_layout: Layout | None = None
    """The reach recipe at this degree: ZeRO-3, full checkpointing, optimizer, parameters
    (DeepSpeed) and activations offloaded, the feed-forward tiled, and the CP algorithm that
    reaches furthest; None where it reaches no further than `longest_seq_len`."""
    offload_host: HostEstimate | None = None
    """The host memory the recipe needs at `offload_seq_len`, on the busiest node."""

    @property
    def gpus(self) -> int:
        """GPUs the job needs at this degree."""
        return self.dims.world_size

    @property
    def fits(self) -> bool:
        return self.legal and self.estimate.fits


@dataclass(frozen=True)
class Suggestion:
    """Another setting at the spec's own CP degree and GPU count that fits."""

    changes: dict[str, Any]
    estimate: MemoryEstimate
    host: HostEstimate | None = None
    """With offload, the node's host memory it needs."""

    def describe(self) -> str:
        text = ", ".join(f"{k} = {v}" for k, v in self.changes.items())
        if self.host is not None:
            text += f" ({self.host.per_node / GiB:,.0f} GiB host memory per node)"
        return text


@dataclass(frozen=True)
class PlanReport:
    spec: JobSpec
    layout: Layout
    estimate: MemoryEstimate
    cp_options: list[CpOption]
    smallest_fitting_cp: CpOption | None
    suggestions: list[Suggestion]
    flops: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    step_time: dict[str, Any] | None = None
    """The step-time model's prediction for this layout (ctxlaunch.perf.steptime), where it fits."""
    phases: list[Phase] = field(default_factory=list)
    """What the busiest rank holds at the highest moment of each phase of a steady-state step
    (`memory.peak_phases`), before the allowance; the largest is the step's peak."""
    host: HostEstimate | None = None
    """With training.offload, the host memory of the busiest node (perf.hostmemory)."""
    accounting: Accounting | None = None
    """The whole run at the predicted step: time to train, GPU-hours, energy, cost
    (perf.accounting), where the job fits."""
    experts: dict[str, Any] | None = None
    """A mixture-of-experts model's own terms (`experts_report`); None for a dense one."""

    @property
    def peak_phase(self) -> Phase | None:
        return max(self.phases, key=lambda p: p.total) if self.phases else None

    @property
    def fits(self) -> bool:
        return self.estimate.fits and (self.host is None or self.host.fits)

    def verdict(self) -> str:
        """One line: fits or not, by how much, and what would fit."""
        e, gib = self.estimate, GiB
        head = f"{e.total / gib:.1f} GiB of {e.capacity / gib:.1f} GiB per {self.spec.cluster.gpu}"
        host = ""
        if self.host is not None:
            h = self.host
            host = (
                f"; host {h.per_node / gib:,.0f} GiB of {h.capacity / gib:,.0f} GiB per node "
                f"({'fits' if h.fits else 'over'})"
            )
        if self.fits:
            return f"fits: {head}, {e.headroom / gib:.1f} GiB headroom{host}"
        if e.fits:
            return (
                f"does not fit: host memory {self.host.per_node / gib:,.0f} GiB per node of "
                f"{self.host.capacity / gib:,.0f} GiB usable (cluster.host_memory_gib); {head}"
                if self.host is not None
                else f"does not fit: {head}"
            )
        out = f"does not fit: {head}, {-e.headroom / gib:.1f} GiB over{host}"
        alternatives = []
        if (
            self.smallest_fitting_cp is not None
            and self.smallest_fitting_cp.dims.cp != self.layout.dims.cp
        ):
            o = self.smallest_fitting_cp
            alternatives.append(
                f"cp = {o.dims.cp} ({o.gpus} GPUs on {o.nodes} node{'s' if o.nodes != 1 else ''})"
            )
        alternatives += [s.describe() for s in self.suggestions[:2]]
        if alternatives:
            out += "; would fit with " + " or ".join(alternatives)
        else:
            out += "; nothing ctxlaunch can vary (CP up to 256, checkpointing, ZeRO) makes it fit"
        return out

    def to_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "job": s.name,
            "gpu": {"type": s.cluster.gpu, "capacity_bytes": self.estimate.capacity},
            "layout": {
                "nodes": s.cluster.nodes,
                "gpus_per_node": s.cluster.gpus_per_node,
                "tp": s.parallel.tp,
                "pp": s.parallel.pp,
                "cp": s.parallel.cp,
                "ep": s.parallel.ep,
                "dp": s.parallel_dims.dp,
                "cp_algorithm": s.parallel.cp_algorithm,
                "ulysses_degree": s.parallel_dims.ulysses_degree,
                "ring_degree": s.parallel_dims.ring_degree,
                "cp_sharding": s.parallel.cp_sharding,
                "seq_len": s.training.seq_len,
                "micro_batch": s.training.micro_batch,
                "grad_accum": s.grad_accum,
                "global_batch": s.global_batch,
                "zero_stage": s.training.zero_stage,
                "activation_checkpointing": s.training.activation_checkpointing,
                "dtype": s.model.dtype,
            },
            "memory": self.estimate.to_dict(),
            "host_memory": self.host.to_dict() if self.host is not None else None,
            "memory_phases": {
                "peak": self.peak_phase.name if self.peak_phase else None,
                "phases": [p.to_dict() for p in self.phases],
            },
            "verdict": self.verdict(),
            "cp_options": [
                {
                    "cp": o.dims.cp,
                    "gpus": o.gpus,
                    "nodes": o.nodes,
                    "legal": o.legal,
                    "reason": o.reason,
                    "total_bytes": o.estimate.total,
                    "fits": o.fits,
                    "longest_seq_len": o.longest_seq_len,
                    "offload_seq_len": o.offload_seq_len,
                    "offload_changes": (
                        layout_changes(self.layout, o.offload_layout)
                        if o.offload_layout is not None
                        else None
                    ),
                    "offload_host_bytes_per_node": (
                        o.offload_host.per_node if o.offload_host is not None else None
                    ),
                }
                for o in self.cp_options
            ],
            "smallest_fitting_cp": (
                self.smallest_fitting_cp.dims.cp if self.smallest_fitting_cp else None
            ),
            "suggestions": [
                {
                    "changes": x.changes,
                    "total_bytes": x.estimate.total,
                    "host_bytes_per_node": x.host.per_node if x.host is not None else None,
                }
                for x in self.suggestions
            ],
            "flops": self.flops,
            "experts": self.experts,
            "step_time": self.step_time,
            "accounting": self.accounting.to_dict() if self.accounting else None,
            "warnings": self.warnings,
        }


def plan_job(spec: JobSpec, machine: Machine | None = None) -> PlanReport:
    """Everything `ctxlaunch plan` reports for a (valid) spec; the step time on `machine`
    (default: the spec's GPU and fabric tables; the CLI passes `machine_for`'s choice)."""
    layout = Layout.from_spec(spec)
    gpu = spec.cluster.gpu_info
    current = estimate(spec.model, layout, gpu)
    host = (
        host_estimate(spec.model, layout, host_limit(spec), current.total)
        if layout.offloads
        else None
    )
    options = cp_options(spec, layout)
    smallest = next((o for o in options if o.fits), None)
    fits = current.fits and (host is None or host.fits)
    step = predict(spec.model, layout, machine or machine_for(spec, saved=False)) if fits else None
    return PlanReport(
        host=host,
        spec=spec,
        layout=layout,
        estimate=current,
        cp_options=options,
        smallest_fitting_cp=smallest,
        suggestions=suggestions(spec, layout),
        flops=flops_report(spec),
        experts=experts_report(spec, layout),
        warnings=spec.warnings(),
        phases=peak_phases(spec.model, layout),
        step_time=step.to_dict() if step is not None else None,
        accounting=account(spec, step) if step is not None else None,
    )


def layout_changes(layout: Layout, other: Layout) -> dict[str, Any]:
    """The `--set` paths whose values differ from `layout` to `other` (the CP degree and
    the batch it implies left out: a CP option's row says them)."""
    mine = layout.overrides()
    return {
        path: value
        for path, value in other.overrides().items()
        if value != mine.get(path)
        and path not in ("parallel.cp", "parallel.dp", "training.global_batch")
    }


def host_limit(spec: JobSpec) -> HostLimit:
    """The node's host memory as the spec states it (or its GPU type's usual node's)."""
    c = spec.cluster
    return HostLimit(c.host_memory_bytes, c.gpus_per_node, cpu=c.gpu == "cpu")


def offload_steps(spec: JobSpec, layout: Layout) -> list[Layout]:
    """The offload recipe (Arctic Long Sequence Training's) for `layout`, step by step, the
    mildest first: ZeRO-3 with full checkpointing and the optimizer's states in host memory;
    then the block inputs too (PP 1); then the feed-forward over tiles of the hidden size; then
    under DeepSpeed the parameters too. Each step adds copies to the step, so the first that
    fits is the fastest way to fit. Empty where FSDP2 has no ranks to shard over."""
    whole = layout.dims.tp == 1 and layout.dims.pp == 1 and layout.dims.ep == 1
    engine = "deepspeed" if whole else "fsdp2"
    if engine == "fsdp2" and layout.dims.shard_group == 1:
        return []  # FSDP2's CPU offload policy needs sharded states
    base = layout.replace(
        zero_stage=3,
        engine=engine,
        activation_checkpointing="full",
        offload_optimizer=True,
        offload_parameters=False,
        offload_activations=False,
        mlp_tile_tokens=0,
    )
    activations = base.replace(offload_activations=layout.dims.pp == 1)
    # A mixture of experts has no dense feed-forward to tile; the attention's tiles still help.
    tile = spec.model.hidden if spec.model.moe is None else 0
    tiled = _with_attention_tiles(activations.replace(mlp_tile_tokens=tile))
    steps = [base, activations, tiled]
    if engine == "deepspeed":
        steps.append(tiled.replace(offload_parameters=True))
    return list(dict.fromkeys(steps))


def offload_recipe(spec: JobSpec, layout: Layout) -> list[Layout]:
    """The whole offload recipe (the last of `offload_steps`) at the layout's CP degree, one
    Layout per CP algorithm legal there."""
    steps = offload_steps(spec, layout)
    if not steps:
        return []
    recipe = steps[-1]
    p = spec.parallel
    out = []
    candidates: list[tuple[str, int | None]] = [(layout.dims.cp_algorithm, None)]
    if layout.dims.cp > 1:
        candidates += [("ulysses", None)] + [
            ("hybrid", u) for u in (2, 4, 8, 16) if u < layout.dims.cp and layout.dims.cp % u == 0
        ]
    for algorithm, ulysses in dict.fromkeys(candidates):
        parallel = p.model_copy(
            update={
                "cp": layout.dims.cp,
                "cp_algorithm": algorithm,
                "ulysses_degree": ulysses,
                "ring_degree": None,
            }
        )
        if cp_problems(spec.model, parallel, spec.training.seq_len):
            continue
        inner = (
            ulysses if ulysses is not None else (layout.dims.cp if algorithm == "ulysses" else 1)
        )
        out.append(
            _with_attention_tiles(recipe.with_dims(cp_algorithm=algorithm, ulysses_degree=inner))
        )
    return out


def _with_attention_tiles(layout: Layout) -> Layout:
    """The tiled step's attention: the ring's backward over tiles of ATTENTION_TILE_TOKENS
    where the layout has a ring, none where it has not (`training.attention_tile_tokens`)."""
    tiles = ATTENTION_TILE_TOKENS if layout.dims.ring_degree > 1 else 0
    return layout.replace(attention_tile_tokens=tiles)


def _offload_reach(
    spec: JobSpec, layout: Layout, plain: int
) -> tuple[int, Layout | None, HostEstimate | None]:
    """The longest sequence the offload recipe reaches at the layout's CP degree, if beyond
    `plain`: (length, the recipe's layout, its host memory there)."""
    gpu, limit = spec.cluster.gpu_info, host_limit(spec)
    best, best_layout = 0, None
    for recipe in offload_recipe(spec, layout):
        n = longest_sequence(spec.model, recipe, gpu, spec.parallel.cp_sharding, host=limit)
        if n > best:
            best, best_layout = n, recipe
    if best_layout is None or best <= plain:
        return 0, None, None
    at = best_layout.replace(seq_len=best)
    host = host_estimate(spec.model, at, limit, estimate(spec.model, at, gpu).total)
    return best, best_layout, host


def cp_options(spec: JobSpec, layout: Layout) -> list[CpOption]:
    """The job at CP 1, 2, 4, ... 256 (and the spec's own degree), DP held fixed."""
    gpu = spec.cluster.gpu_info
    p = spec.parallel
    degrees = sorted({1 << i for i in range(MAX_CP.bit_length())} | {p.cp})
    per_node = spec.cluster.gpus_per_node
    out = []
    for cp in degrees:
        variant = layout.with_dims(cp=cp)
        gpus = variant.dims.world_size
        problems = cp_problems(spec.model, p.model_copy(update={"cp": cp}), spec.training.seq_len)
        reason = problem_message(problems[0]) if problems else None
        longest = longest_sequence(spec.model, variant, gpu, p.cp_sharding, host=host_limit(spec))
        reach, recipe, host = (0, None, None)
        if not layout.offloads:
            reach, recipe, host = _offload_reach(spec, variant, longest)
        out.append(
            CpOption(
                dims=variant.dims,
                nodes=-(-gpus // per_node),
                legal=not problems,
                reason=reason,
                estimate=estimate(spec.model, variant, gpu),
                longest_seq_len=longest,
                offload_seq_len=reach,
                offload_layout=recipe,
                offload_host=host,
            )
        )
    return out


def suggestions(spec: JobSpec, layout: Layout) -> list[Suggestion]:
    """Cheaper-to-run settings that fit at the spec's own CP degree: more activation
    checkpointing, then higher ZeRO stages, mildest change first."""
    modes = ["none", "selective", "full"]
    gpu = spec.cluster.gpu_info
    out = []
    for mode in modes[modes.index(layout.activation_checkpointing) :]:
        for stage in range(layout.zero_stage, 4):
            if (mode, stage) == (layout.activation_checkpointing, layout.zero_stage):
                continue
            e = estimate(
                spec.model, layout.replace(activation_checkpointing=mode, zero_stage=stage), gpu
            )
            if e.fits:
                changes: dict[str, Any] = {}
                if mode != layout.activation_checkpointing:
                    changes["training.activation_checkpointing"] = mode
                if stage != layout.zero_stage:
                    changes["training.zero_stage"] = stage
                out.append(Suggestion(changes, e))
                break  # the lowest ZeRO stage that fits with this checkpointing mode
    if not out:
        out.extend(offload_suggestions(spec, layout))
    return out


def offload_suggestions(spec: JobSpec, layout: Layout) -> list[Suggestion]:
    """Where nothing else fits at the spec's CP degree: the mildest step of the offload recipe
    that fits device and host memory (`offload_steps`)."""
    limit, gpu = host_limit(spec), spec.cluster.gpu_info
    for candidate in offload_steps(spec, layout):
        if fits_with_host(spec.model, candidate, gpu, limit):
            e = estimate(spec.model, candidate, gpu)
            host = host_estimate(spec.model, candidate, limit, e.total)
            return [Suggestion(layout_changes(layout, candidate), e, host)]
    return []


def flops_report(spec: JobSpec) -> dict[str, Any]:
    counts = count_params(spec.model)
    s = spec.training.seq_len
    world = spec.cluster.world_size
    per_token = {c: flops_per_token(spec.model, s, c) for c in CONVENTIONS}
    return {
        "params_total": counts.total,
        "params_active": counts.active,
        "params_matmul": counts.matmul,
        "tokens_per_step": spec.tokens_per_step,
        "per_token": per_token,
        "per_step": {c: v * spec.tokens_per_step for c, v in per_token.items()},
        "per_gpu_per_step": {c: v * spec.tokens_per_step / world for c, v in per_token.items()},
        "conventions": {
            "full": "attention counts the whole s x s score matrix (PaLM, torchtitan, NeMo)",
            "causal": "attention halved for causal masking (Megatron-LM)",
        },
    }


def experts_report(spec: JobSpec, layout: Layout) -> dict[str, Any] | None:
    """A mixture-of-experts model's terms on the busiest rank (ctxlaunch.perf.moecost): total
    and active parameters, the experts' parameters and states it holds, the routing load the
    plan admits and the dispatch buffers and experts' activations at it, and the all-to-all's
    bytes per step, inside a node and across nodes. None for a dense model."""
    model = spec.model
    moe = model.moe
    if moe is None:
        return None
    counts = count_params(model)
    held = stage_expert_params(model, layout)
    states = state_bytes(model, layout, held, experts=held)
    tokens = layout.tokens_per_rank / layout.dims.tp
    routed = moe.experts_per_token * moecost.routed_load(model, layout) * tokens
    stage_moe_layers = counts.moe_layers * max(layout.rank_layers(model.layers)) / model.layers
    per_step = (
        moecost.all_to_all_bytes(model, layout)
        * stage_moe_layers
        * layout.grad_accum
        * (1.5 if layout.activation_checkpointing != "none" else 1.0)
    )
    inside, across = moecost.all_to_all_split(layout, spec.cluster.gpus_per_node)
    return {
        "experts": moe.experts,
        "experts_per_token": moe.experts_per_token,
        "moe_layers": counts.moe_layers,
        "params_total": counts.total,
        "params_active": counts.active,
        "expert_params_per_rank": held,
        "expert_states_bytes_per_rank": {
            "parameters": states[0],
            "gradients": states[1],
            "optimizer_states": states[2],
        },
        "experts_sharded_over": layout.dims.expert_shard_group,
        "routed_load": moecost.routed_load(model, layout),
        "routings_per_layer_per_rank": routed,
        "expert_activation_bytes_per_layer": routed
        * moecost.expert_bytes_per_routing(model, layout),
        "dispatch_buffer_bytes": moecost.dispatch_buffer_bytes(model, layout),
        "all_to_all_bytes_per_step": per_step,
        "all_to_all_bytes_per_step_in_node": per_step * inside,
        "all_to_all_bytes_per_step_across_nodes": per_step * across,
        "capacity_factor": moe.capacity_factor,
    }
