"""`ctxlaunch plan`: memory against capacity, the CP degrees that fit, and model FLOPs.

Combines the memory model (memory.py), the FLOPs model (flops.py) and the layout rules
(spec.cp_problems) into one report, as a table for people and a dict for programs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxlaunch.contract.hardware import GiB
from ctxlaunch.contract.spec import JobSpec, cp_problems, problem_message
from ctxlaunch.perf.flops import CONVENTIONS, count_params, flops_per_token
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine, machine_for
from ctxlaunch.perf.memory import MemoryEstimate, estimate, longest_sequence
from ctxlaunch.perf.peakphases import Phase, peak_phases
from ctxlaunch.perf.steptime import predict

MAX_CP = 256


@dataclass(frozen=True)
class CpOption:
    """The job at another CP degree, with TP, PP, EP and DP held."""

    cp: int
    gpus: int
    nodes: int
    legal: bool
    """Whether the spec's CP algorithm and layout allow this degree at the spec's seq_len."""
    reason: str | None
    estimate: MemoryEstimate
    longest_seq_len: int
    """The longest sequence that fits at this degree (legal for the layout)."""

    @property
    def fits(self) -> bool:
        return self.legal and self.estimate.fits


@dataclass(frozen=True)
class Suggestion:
    """Another setting at the spec's own CP degree and GPU count that fits."""

    changes: dict[str, Any]
    estimate: MemoryEstimate

    def describe(self) -> str:
        return ", ".join(f"{k} = {v}" for k, v in self.changes.items())


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

    @property
    def peak_phase(self) -> Phase | None:
        return max(self.phases, key=lambda p: p.total) if self.phases else None

    @property
    def fits(self) -> bool:
        return self.estimate.fits

    def verdict(self) -> str:
        """One line: fits or not, by how much, and what would fit."""
        e, gib = self.estimate, GiB
        head = f"{e.total / gib:.1f} GiB of {e.capacity / gib:.1f} GiB per {self.spec.cluster.gpu}"
        if e.fits:
            return f"fits: {head}, {e.headroom / gib:.1f} GiB headroom"
        out = f"does not fit: {head}, {-e.headroom / gib:.1f} GiB over"
        alternatives = []
        if self.smallest_fitting_cp is not None and self.smallest_fitting_cp.cp != self.layout.cp:
            o = self.smallest_fitting_cp
            alternatives.append(
                f"cp = {o.cp} ({o.gpus} GPUs on {o.nodes} node{'s' if o.nodes != 1 else ''})"
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
                "dp": s.dp,
                "cp_algorithm": s.parallel.cp_algorithm,
                "ulysses_degree": s.ulysses_degree,
                "ring_degree": s.ring_degree,
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
            "memory_phases": {
                "peak": self.peak_phase.name if self.peak_phase else None,
                "phases": [p.to_dict() for p in self.phases],
            },
            "verdict": self.verdict(),
            "cp_options": [
                {
                    "cp": o.cp,
                    "gpus": o.gpus,
                    "nodes": o.nodes,
                    "legal": o.legal,
                    "reason": o.reason,
                    "total_bytes": o.estimate.total,
                    "fits": o.fits,
                    "longest_seq_len": o.longest_seq_len,
                }
                for o in self.cp_options
            ],
            "smallest_fitting_cp": (
                self.smallest_fitting_cp.cp if self.smallest_fitting_cp else None
            ),
            "suggestions": [
                {"changes": x.changes, "total_bytes": x.estimate.total} for x in self.suggestions
            ],
            "flops": self.flops,
            "step_time": self.step_time,
            "warnings": self.warnings,
        }


def plan_job(spec: JobSpec, machine: Machine | None = None) -> PlanReport:
    """Everything `ctxlaunch plan` reports for a (valid) spec; the step time on `machine`
    (default: the spec's GPU and fabric tables; the CLI passes `machine_for`'s choice)."""
    layout = Layout.from_spec(spec)
    gpu = spec.cluster.gpu_info
    current = estimate(spec.model, layout, gpu)
    options = cp_options(spec, layout)
    smallest = next((o for o in options if o.fits), None)
    return PlanReport(
        spec=spec,
        layout=layout,
        estimate=current,
        cp_options=options,
        smallest_fitting_cp=smallest,
        suggestions=suggestions(spec, layout),
        flops=flops_report(spec),
        warnings=spec.warnings(),
        phases=peak_phases(spec.model, layout),
        step_time=(
            predict(spec.model, layout, machine or machine_for(spec, saved=False)).to_dict()
            if current.fits
            else None
        ),
    )


def cp_options(spec: JobSpec, layout: Layout) -> list[CpOption]:
    """The job at CP 1, 2, 4, ... 256 (and the spec's own degree), DP held fixed."""
    gpu = spec.cluster.gpu_info
    p = spec.parallel
    degrees = sorted({1 << i for i in range(MAX_CP.bit_length())} | {p.cp})
    per_node = spec.cluster.gpus_per_node
    out = []
    for cp in degrees:
        variant = layout.replace(cp=cp)
        gpus = p.tp * p.pp * p.ep * cp * layout.dp
        problems = cp_problems(spec.model, p.model_copy(update={"cp": cp}), spec.training.seq_len)
        reason = problem_message(problems[0]) if problems else None
        out.append(
            CpOption(
                cp=cp,
                gpus=gpus,
                nodes=-(-gpus // per_node),
                legal=not problems,
                reason=reason,
                estimate=estimate(spec.model, variant, gpu),
                longest_seq_len=longest_sequence(spec.model, variant, gpu, p.cp_sharding),
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
    return out


def flops_report(spec: JobSpec) -> dict[str, Any]:
    counts = count_params(spec.model)
    s = spec.training.seq_len
    world = spec.cluster.world_size
    per_token = {c: flops_per_token(spec.model, s, c) for c in CONVENTIONS}
    return {
        "params_total": counts.total,
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
