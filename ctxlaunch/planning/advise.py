"""`ctxlaunch advise`: every legal layout for a spec's model, sequence and cluster, ranked by the
step-time model among those the planner says fit.

The search holds what the user fixed (model, sequence length, tokens per step, GPU type,
fabric, the CP sharding layout) and varies the rest: TP (within the NVLink domain), PP and its
virtual stages, CP degree and algorithm (ring, Ulysses, hybrid with each Ulysses degree), DP
(what is left), for a mixture-of-experts model the EP degree (every one that divides dp x cp
and the expert count: it borrows its ranks from them), ZeRO stage, activation checkpointing
and micro-batch. Legality is the spec
validator's own (`spec.layout_problems`), never a copy of its rules.

Pruning, so a 70B model on 512 GPUs answers in about a second:
- one validator call per set of degrees, then per virtual-stage count and micro-batch;
- memory first: if a layout does not fit with full checkpointing and ZeRO-3 at one sequence
  per micro-batch, nothing of it fits (memory only grows with less of either or a larger
  micro-batch), so nothing of it is timed;
- of the (checkpointing, ZeRO) settings that fit, only the two lightest checkpointing modes
  are timed: more recomputation than a setting that already fits only adds time.
Every layout is accounted for: ranked (the fastest setting of each set of degrees), or
rejected as illegal (the validator's reason), no fit (the planner's total), or dominated
(fits, but slower than the ranked setting of the same degrees, or pruned as above).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ctxlaunch.contract.hardware import GiB, GpuInfo
from ctxlaunch.contract.spec import JobSpec, ModelSpec, layout_problems, problem_message
from ctxlaunch.perf.accounting import Accounting, account
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine, machine_for
from ctxlaunch.perf.memory import MemoryEstimate, estimate, fits_with_host
from ctxlaunch.perf.steptime import StepTime, predict
from ctxlaunch.planning.plan import host_limit, offload_steps

CHECKPOINTING = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VIRTUAL_STAGES = 8


RANK_BY = ("step", "time", "cost")
"""What `advise` ranks by: the predicted step time, the time to train the run (across GPU
counts: more GPUs, shorter), or its cost (GPU-hours x cluster.gpu_hour_price)."""


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its predicted memory and step time, and the whole run at it."""

    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    accounting: Accounting | None = None
    """The run at this layout: time to train, GPU-hours, energy, cost (perf.accounting)."""
    nodes: int = 1
    gpus_per_node: int = 1
    """The node shape the layout was searched on."""

    @property
    def gpus(self) -> int:
        return self.layout.dims.world_size

    def metric(self, rank_by: str) -> float:
        """The figure `rank_by` ranks on (RANK_BY): seconds a step, seconds the run, or its
        cost."""
        a = self.accounting
        if rank_by == "time" and a is not None:
            return a.seconds.value
        if rank_by == "cost" and a is not None and a.cost is not None:
            return a.cost.value
        return self.time.step_seconds

    def describe(self) -> str:
        """The layout in one line, as the table and the rejections name it."""
        lay = self.layout
        v = f" v{lay.dims.virtual_stages}" if lay.dims.virtual_stages > 1 else ""
        memory = lay.describe_memory_settings()
        sharding = (
            f" {lay.dims.cp_sharding}"
            if lay.dims.ring_degree > 1 and lay.dims.cp_sharding == "balanced"
            else ""
        )
        return (
            f"{lay.dims.describe()}{sharding}{v}, mb {lay.micro_batch}, "
            f"ZeRO-{lay.zero_stage}, "
            f"checkpointing {lay.activation_checkpointing}" + (f", {memory}" if memory else "")
        )

    def to_dict(self) -> dict[str, Any]:
        """The candidate for --json, with the `--set` overrides that make a spec run it."""
        return {
            "layout": self.describe(),
            "changes": self.layout.overrides(),
            "gpus": self.gpus,
            "memory_total_bytes": self.memory.total,
            "fits": self.memory.fits,
            **self.time.to_dict(),
            "accounting": self.accounting.to_dict() if self.accounting else None,
        }


@dataclass(frozen=True)
class Rejection:
    kind: str
    """illegal, no fit, or dominated."""
    layout: str
    reason: str


@dataclass
class Advice:
    spec: JobSpec
    nodes: int
    gpus_per_node: int
    ranked: list[Candidate]
    rejected: list[Rejection]
    layouts_timed: int = 0
    """Step-time predictions made (what pruning keeps small)."""
    memory_estimates: int = 0
    validator_calls: int = 0
    notes: list[str] = field(default_factory=list)
    own: StepTime | None = None
    """The spec's own layout, predicted, where it is legal and fits on the same GPUs."""
    own_accounting: Accounting | None = None
    """The whole run at the spec's own layout (with `own`)."""
    rank_by: str = "step"
    """What the ranking orders by (RANK_BY)."""
    gpu_counts: tuple[int, ...] = ()
    """The GPU counts searched, where more than one was (`merge`)."""

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def expected_error(self) -> float:
        """The model's expected relative error here (its profile's held-out check)."""
        return self.best.time.expected_error if self.best else 0.0

    def ties_best(self, candidate: Candidate) -> bool:
        """Whether `candidate` is within the model's expected error of the best (the fastest,
        or the cheapest): the model cannot tell them apart, so they rank as ties."""
        if self.best is None:
            return False
        limit = self.best.metric(self.rank_by) * (1 + self.expected_error)
        return candidate.metric(self.rank_by) <= limit

    def rerank(self, rank_by: str) -> None:
        """Order the ranked layouts by `rank_by` (RANK_BY)."""
        self.rank_by = rank_by
        self.ranked.sort(key=lambda c: (float(f"{c.metric(rank_by):.4g}"), *_rank_key(c)))

    def rank_labels(self, top: int | None = None) -> list[str]:
        """'1', or '=1' for every layout tied with the fastest, then their own ranks."""
        tied = sum(1 for c in self.ranked if self.ties_best(c))
        return [
            "=1" if tied > 1 and self.ties_best(c) else str(i)
            for i, c in enumerate(self.ranked[:top], 1)
        ]

    def rejected_by_kind(self) -> dict[str, list[Rejection]]:
        out: dict[str, list[Rejection]] = {"illegal": [], "no fit": [], "dominated": []}
        for r in self.rejected:
            out[r.kind].append(r)
        return out

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        groups = self.rejected_by_kind()
        return {
            "job": self.spec.name,
            "gpu": self.spec.cluster.gpu,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "seq_len": self.spec.training.seq_len,
            "tokens_per_step": self.spec.tokens_per_step,
            "steps": self.spec.training.steps,
            "rank_by": self.rank_by,
            "gpu_counts": list(self.gpu_counts) or [self.nodes * self.gpus_per_node],
            "layouts_timed": self.layouts_timed,
            "memory_estimates": self.memory_estimates,
            "validator_calls": self.validator_calls,
            "ranked": [
                {**c.to_dict(), "rank": label, "tied_with_best": label == "=1"}
                for c, label in zip(self.ranked[:top], self.rank_labels(top), strict=True)
            ],
            "ranked_total": len(self.ranked),
            "expected_error": self.expected_error,
            "tied_with_best": sum(1 for c in self.ranked if self.ties_best(c)),
            "own_layout": self.own.to_dict() if self.own else None,
            "rejected": {
                kind: {
                    "count": len(items),
                    "layouts": [{"layout": r.layout, "reason": r.reason} for r in items],
                }
                for kind, items in groups.items()
            },
            "notes": self.notes,
        }


def _rank_key(c: Candidate) -> tuple[float, int, int, int, int, int]:
    """Fastest first; among layouts the model cannot tell apart (same step time to four
    digits), the simpler one: less model parallelism (TP x PP x CP), lower ZeRO stage, smaller
    micro-batch, fewer virtual stages, then less memory."""
    lay = c.layout
    return (
        float(f"{c.time.step_seconds:.4g}"),
        lay.dims.tp * lay.dims.pp * lay.dims.cp,
        lay.zero_stage,
        lay.micro_batch,
        lay.dims.virtual_stages,
        c.memory.total,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _with_global_batch(spec: JobSpec, global_batch: int) -> JobSpec:
    """`spec` with this many sequences per step (not re-validated)."""
    return spec.model_copy(
        update={
            "training": spec.training.model_copy(
                update={"global_batch": global_batch, "grad_accum": None}
            )
        }
    )


def degree_options(
    spec: JobSpec, world: int, gpus_per_node: int, nvlink_domain: int
) -> list[Layout]:
    """Every split of `world` GPUs into TP x PP x CP x DP with a CP algorithm, as layouts of
    `spec` (one sequence per micro-batch, the tokens per step held); TP stays inside the NVLink
    domain (and a node); PP up to one layer per stage. Under a document mask with a known
    document length, a ring (or hybrid) whose fixed sharding leaves its busiest rank more
    attention than the mean is also offered with the balanced sharding."""
    model = spec.model
    global_batch = spec.global_batch
    # What the search holds comes from the spec; the split and the pipeline are its own.
    base = (
        Layout.from_spec(spec).with_dims(virtual_stages=1).replace(micro_batch=1, stage_layers=())
    )

    def split(tp: int, pp: int, cp: int, dp: int, algorithm: str, ulysses: int) -> Layout:
        return base.with_dims(
            tp=tp, pp=pp, cp=cp, dp=dp, cp_algorithm=algorithm, ulysses_degree=ulysses, ep=1
        ).replace(grad_accum=max(global_batch // dp, 1))

    def with_experts(layouts: list[Layout]) -> list[Layout]:
        """Each layout at every EP degree a mixture-of-experts model takes there."""
        if model.moe is None:
            return layouts
        experts = model.moe.experts
        return [
            lay.with_dims(ep=ep)
            for lay in layouts
            for ep in _divisors(lay.dims.shard_group)
            if experts % ep == 0
        ]

    tp_limit = min(nvlink_domain, gpus_per_node)
    pp_limit = model.layers
    out = []
    for tp in _divisors(world):
        if tp > tp_limit:
            break
        for pp in _divisors(world // tp):
            if pp > pp_limit:
                break
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if cp == 1:
                    out.append(split(tp, pp, 1, dp, "ring", 1))
                    continue
                rings = [split(tp, pp, cp, dp, "ring", 1)] + [
                    split(tp, pp, cp, dp, "hybrid", ulysses)
                    for ulysses in _divisors(cp)
                    if 1 < ulysses < cp
                ]
                out.append(rings[0])
                out.append(split(tp, pp, cp, dp, "ulysses", cp))
                out.extend(rings[1:])
                out.extend(
                    ring.with_dims(cp_sharding="balanced")
                    for ring in rings
                    if ring.attention_imbalance > 1.0
                )
    return with_experts(out)


@dataclass
class _Search:
    """One `advise` run: the spec whose layouts it varies, the machine it times them on, and the
    advice it fills in (rankings, rejections and the counts of what it asked)."""

    advice: Advice
    base: JobSpec
    machine: Machine
    gpu: GpuInfo
    global_batch: int

    @property
    def model(self) -> ModelSpec:
        return self.base.model

    def problem(self, variant: JobSpec) -> str | None:
        """The validator's first problem with `variant`, or None where it is legal."""
        self.advice.validator_calls += 1
        problems = layout_problems(variant)
        return problem_message(problems[0]) if problems else None

    def memory(self, layout: Layout) -> MemoryEstimate:
        self.advice.memory_estimates += 1
        return estimate(self.model, layout, self.gpu)

    def reject(self, kind: str, layout: str, reason: str) -> None:
        self.advice.rejected.append(Rejection(kind, layout, reason))

    def search_degrees(self, degrees: Layout) -> None:
        """Rank the fastest setting of one set of degrees; reject the rest, or the degrees."""
        # The validator sees the global batch the search holds (a layout only names it as
        # micro-batch x grad_accum x dp, which rounds where dp does not divide it).
        why = self.problem(_with_global_batch(degrees.apply_to(self.base), self.global_batch))
        if why is not None:
            self.reject("illegal", degrees.dims.describe(), why)
            return
        timed: list[Candidate] = []
        for micro_batch in MICRO_BATCHES:
            candidates = self.time_micro_batch(degrees, micro_batch)
            if candidates is None:
                break  # a larger micro-batch needs more
            timed.extend(candidates)
        if not timed:
            return
        timed.sort(key=_rank_key)
        fastest = timed[0]
        self.advice.ranked.append(fastest)
        for other in timed[1:]:
            self.reject(
                "dominated",
                other.describe(),
                f"{other.time.step_seconds / fastest.time.step_seconds - 1:+.1%} step time "
                f"against {fastest.describe()}",
            )

    def time_micro_batch(self, degrees: Layout, micro_batch: int) -> list[Candidate] | None:
        """The candidates of `degrees` at `micro_batch` sequences per micro-batch that fit,
        timed; None when not even the leanest setting fits (nor will a larger micro-batch)."""
        if self.global_batch % (micro_batch * degrees.dims.dp):
            return []
        layout = degrees.replace(
            micro_batch=micro_batch, grad_accum=self.global_batch // (micro_batch * degrees.dims.dp)
        )
        if micro_batch > 1 and self.problem(layout.apply_to(self.base)):
            return []
        leanest = self.memory(layout.replace(activation_checkpointing="full", zero_stage=3))
        if not leanest.fits:
            offloaded = self.offload_candidate(layout)
            if offloaded is not None:
                return [offloaded]
            self.reject(
                "no fit",
                degrees.dims.describe() + f", mb {micro_batch}",
                f"{leanest.total / GiB:.1f} GiB with full checkpointing "
                f"and ZeRO-3, of {leanest.capacity / GiB:.1f} GiB",
            )
            return None
        settings = self.fitting_settings(layout)
        timed_settings, pruned = settings[:2], settings[2:]
        for group in pruned:
            for mode, zero_stage in group:
                self.reject(
                    "dominated",
                    f"{degrees.dims.describe()}, mb {micro_batch}, ZeRO-{zero_stage}, "
                    f"checkpointing {mode}",
                    "fits, but recomputes more than a lighter "
                    "setting of the same layout that also fits",
                )
        candidates = []
        for virtual_stages in self.virtual_stage_options(degrees):
            if virtual_stages > 1 and self.problem(
                layout.with_dims(virtual_stages=virtual_stages).apply_to(self.base)
            ):
                continue
            for mode, zero_stage in itertools.chain.from_iterable(timed_settings):
                candidate = self.time_setting(
                    layout.with_dims(virtual_stages=virtual_stages).replace(
                        activation_checkpointing=mode, zero_stage=zero_stage
                    )
                )
                if candidate is not None:
                    candidates.append(candidate)
        return candidates

    def offload_candidate(self, layout: Layout) -> Candidate | None:
        """Where nothing fits on the device alone: the mildest step of the offload recipe that
        fits device and host memory (`plan.offload_steps`: the fastest way to fit), timed."""
        limit = host_limit(self.base)
        for step in offload_steps(self.base, layout):
            self.advice.memory_estimates += 1
            if fits_with_host(self.model, step, self.gpu, limit):
                return self.time_setting(step)
        return None

    def fitting_settings(self, layout: Layout) -> list[list[tuple[str, int]]]:
        """Per checkpointing mode, lightest first, the (mode, ZeRO stage) settings of `layout`
        that fit; modes where none fits are left out."""
        settings = []
        for mode in CHECKPOINTING:
            fitting = [
                (mode, zero_stage)
                for zero_stage in ZERO_STAGES
                if self.memory(
                    layout.replace(activation_checkpointing=mode, zero_stage=zero_stage)
                ).fits
            ]
            if fitting:
                settings.append(fitting)
        return settings

    def virtual_stage_options(self, degrees: Layout) -> list[int]:
        """Virtual stages per rank to try: those that divide each stage's blocks, up to
        MAX_VIRTUAL_STAGES (1 without PP)."""
        if degrees.dims.pp == 1:
            return [1]
        return [
            virtual_stages
            for virtual_stages in _divisors(self.model.layers // degrees.dims.pp)
            if virtual_stages <= MAX_VIRTUAL_STAGES
        ]

    def time_setting(self, layout: Layout) -> Candidate | None:
        """`layout` timed where it fits (else rejected). Interleaved stages hold more warm-up
        micro-batches than one stage per rank, where the setting was found to fit: each is
        checked at its own virtual stages."""
        memory = self.memory(layout)
        if not memory.fits:
            self.reject(
                "no fit",
                f"{layout.dims.describe()} v{layout.dims.virtual_stages}, mb {layout.micro_batch}, "
                f"ZeRO-{layout.zero_stage}, checkpointing {layout.activation_checkpointing}",
                f"{memory.total / GiB:.1f} GiB with {layout.dims.virtual_stages} virtual "
                f"stages, of {memory.capacity / GiB:.1f} GiB",
            )
            return None
        self.advice.layouts_timed += 1
        time = predict(self.model, layout, self.machine)
        cluster = self.base.cluster
        return Candidate(
            layout,
            memory,
            time,
            account(self.base, time),
            nodes=cluster.nodes,
            gpus_per_node=cluster.gpus_per_node,
        )


def advise(
    spec: JobSpec,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    machine: Machine | None = None,
    matmul_precision: str | None = None,
) -> Advice:
    """Rank every legal layout of `spec` on `nodes` x `gpus_per_node` GPUs (the spec's own by
    default; on `machine`, else the spec's tables: the CLI passes `machine_for`'s choice, with
    any saved CPU calibration). The tokens per step (global batch x seq_len) are held.
    `matmul_precision` fp8 ranks as if the weight matmuls ran in FP8 (the bundled trainer runs
    bf16/fp32 only). On a Megatron-profile machine (`--framework megatron`) the layouts are
    planned with Megatron's memory habits too (Layout.framework)."""
    nodes = nodes or spec.cluster.nodes
    per_node = gpus_per_node or spec.cluster.gpus_per_node
    cluster = spec.cluster.model_copy(update={"nodes": nodes, "gpus_per_node": per_node})
    base = spec.model_copy(update={"cluster": cluster})
    machine = machine or machine_for(base, saved=False)
    advice = Advice(spec=base, nodes=nodes, gpus_per_node=per_node, ranked=[], rejected=[])
    search = _Search(advice, base, machine, cluster.gpu_info, spec.global_batch)
    for degrees in degree_options(base, nodes * per_node, per_node, machine.nvlink_domain):
        if matmul_precision is not None:
            degrees = degrees.replace(matmul_precision=matmul_precision)
        if machine.framework == "megatron":
            degrees = degrees.replace(framework="megatron")
        search.search_degrees(degrees)
    advice.ranked.sort(key=_rank_key)
    if (nodes, per_node) == (
        spec.cluster.nodes,
        spec.cluster.gpus_per_node,
    ) and not layout_problems(spec):
        own = Layout.from_spec(spec)
        if estimate(spec.model, own, search.gpu).fits:
            advice.own = predict(spec.model, own, machine)
            advice.own_accounting = account(spec, advice.own)
    if not advice.ranked:
        advice.notes.append(
            "no layout fits on this many GPUs: add GPUs (--gpus, --nodes) or shorten the sequence"
        )
    return advice


def merge(advices: list[Advice], rank_by: str) -> Advice:
    """One ranking of the advice for several GPU counts (each `advise` on the same spec), by
    `rank_by`: the spec's own count's advice first in `advices`."""
    first = advices[0]
    mine = next((a for a in advices if a.own is not None), first)
    merged = Advice(
        spec=first.spec,
        nodes=first.nodes,
        gpus_per_node=first.gpus_per_node,
        ranked=[c for a in advices for c in a.ranked],
        rejected=[r for a in advices for r in a.rejected],
        layouts_timed=sum(a.layouts_timed for a in advices),
        memory_estimates=sum(a.memory_estimates for a in advices),
        validator_calls=sum(a.validator_calls for a in advices),
        notes=[n for a in advices for n in a.notes],
        own=mine.own,
        own_accounting=mine.own_accounting,
        gpu_counts=tuple(a.nodes * a.gpus_per_node for a in advices),
    )
    merged.rerank(rank_by)
    return merged


# --------------------------------------------------------------------------------------------
# the command's input and output
# --------------------------------------------------------------------------------------------
def load_for_advice(
    path: Any, overrides: list[str] | None, source: str | None = None
) -> tuple[dict[str, Any], JobSpec, str | None]:
    """(the spec's data with the overrides, the validated spec, a note) from a spec file (or
    its mapping, named `source`). A spec whose only problems are its layout is still advised
    on: its parallel section is reset to one GPU per replica (the search varies it anyway) and
    the note says so. Anything else raises the SpecError."""
    from collections.abc import Mapping

    from ctxlaunch.contract.loader import SpecError, apply_overrides, read_spec_data, validate_spec

    if isinstance(path, Mapping):
        raw, path = dict(path), source or "<spec>"
    else:
        raw = read_spec_data(path)
    data = apply_overrides(raw, overrides or ())
    try:
        return data, validate_spec(data, str(path)), None
    except SpecError as exc:
        layout_only = all(
            p.path.startswith(
                ("parallel", "training.seq_len", "training.global_batch", "training.grad_accum")
            )
            for p in exc.problems
        )
        if not layout_only:
            raise
        reset = {
            k: v for k, v in (data.get("parallel") or {}).items() if k in ("cp_sharding", "layout")
        }
        try:
            job = validate_spec({**data, "parallel": reset}, str(path))
        except SpecError:
            raise exc from None
        return (
            data,
            job,
            (f"the spec's own layout is illegal ({exc.problems[0]}); advising over every layout"),
        )


def advice_spec_text(data: dict[str, Any], advice: Advice, source: str) -> str:
    """The user's spec (their own YAML mapping, presets kept) with the fastest layout set;
    validated before it is written."""
    import json

    import yaml

    from ctxlaunch.contract.loader import apply_overrides, validate_spec

    assert advice.best is not None
    changes = {
        **advice.best.layout.overrides(),
        "cluster.nodes": advice.best.nodes,
        "cluster.gpus_per_node": advice.best.gpus_per_node,
    }
    new = apply_overrides(data, [f"{k}={json.dumps(v)}" for k, v in changes.items()])
    for section in ("parallel", "training"):  # drop the nulls the changes set
        new[section] = {k: v for k, v in new[section].items() if v is not None}
    if not any(new["training"].get("offload", {}).values()):
        new["training"].pop("offload", None)  # nothing offloaded: the default, left unsaid
    validate_spec(new, source)
    header = (
        f"# ctxlaunch advise: {advice.best.describe()}; predicted "
        f"{advice.best.time.step_seconds:.3g} s/step, "
        f"{advice.best.time.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, "
        f"{advice.best.memory.total / GiB:.1f} GiB/GPU\n"
    )
    return header + yaml.safe_dump(new, sort_keys=False)


TITLES = {
    "step": "Fastest layouts that fit",
    "time": "Quickest layouts to train the run",
    "cost": "Cheapest layouts to train the run",
}
COMPUTE_TERMS = ("compute_matmul", "compute_attention", "compute_elementwise", "compute_loss")


def _advice_columns(advice: Advice) -> list[str]:
    columns = ["#", "layout"]
    if advice.gpu_counts:
        columns.append("GPUs")
    columns += ["GiB/GPU", "step s", "tokens/s/GPU", "MFU full", "MFU causal", "time to train"]
    if advice.spec.cluster.price_per_gpu_hour is not None:
        columns.append("cost")
    return [*columns, "largest overhead"]


def _advice_row(advice: Advice, label: str, c: Candidate) -> list[str]:
    """One ranked layout as `_advice_columns` names its cells."""
    from ctxlaunch.perf.accounting import amount, duration

    overheads = {
        k: v
        for k, v in c.time.terms.items()
        if k not in COMPUTE_TERMS and v > 1e-3 * c.time.step_seconds
    }
    worst = max(overheads, key=overheads.__getitem__) if overheads else None
    row = [label, c.describe()]
    if advice.gpu_counts:
        row.append(str(c.gpus))
    row += [
        f"{c.memory.total / GiB:,.1f}",
        f"{c.time.step_seconds:.4g}",
        f"{c.time.tokens_per_second_per_gpu:,.0f}",
        f"{c.time.mfu['full']:.1%}",
        f"{c.time.mfu['causal']:.1%}",
        duration(c.accounting.seconds.value) if c.accounting else "",
    ]
    if advice.spec.cluster.price_per_gpu_hour is not None:
        cost = c.accounting.cost if c.accounting else None
        row.append(amount(cost.value) if cost else "")
    row.append(
        f"{worst.replace('_', ' ')} {overheads[worst] / c.time.step_seconds:.1%}" if worst else "-"
    )
    return row


def _own_line(advice: Advice, own: StepTime, best: Candidate) -> str:
    """The spec's own layout against the best, by what the ranking orders by."""
    from ctxlaunch.perf.accounting import duration

    s = advice.spec
    p, t = s.parallel, s.training
    line = (
        f"the spec's own layout (tp {p.tp} pp {p.pp} cp {p.cp} {p.cp_algorithm}, "
        f"ZeRO-{t.zero_stage}, checkpointing {t.activation_checkpointing}): "
        f"{own.step_seconds:.4g} s/step, {own.tokens_per_second_per_gpu:,.0f} tokens/s/GPU"
    )
    mine = advice.own_accounting
    if advice.rank_by == "step" or mine is None or best.accounting is None:
        return (
            line
            + f"; the fastest's step is {1 - best.time.step_seconds / own.step_seconds:.1%} shorter"
        )
    if advice.rank_by == "time":
        return line + (
            f", {duration(mine.seconds.value)} to train; the quickest takes "
            f"{1 - best.accounting.seconds.value / mine.seconds.value:.1%} less"
        )
    if mine.cost is None or best.accounting.cost is None:
        return line
    return line + (
        f", costs {mine.cost.value:,.0f}; the cheapest costs "
        f"{1 - best.accounting.cost.value / mine.cost.value:.1%} less"
    )


def print_advice(console: Any, advice: Advice, top: int) -> None:
    from rich.table import Table

    s = advice.spec
    for note in advice.notes:
        console.print(f"note: {note}", markup=False)
    gpus = (
        " or ".join(str(n) for n in advice.gpu_counts) + f" {s.cluster.gpu}"
        if advice.gpu_counts
        else f"{advice.nodes} x {advice.gpus_per_node} {s.cluster.gpu}"
    )
    console.print(
        f"[bold]{s.name}[/]: {s.model.preset or 'custom'} model, seq_len "
        f"{s.training.seq_len:,}, {s.tokens_per_step:,} tokens per step x "
        f"{s.training.steps:,} steps, {gpus} over {s.fabric.network}"
    )
    table = Table(
        title=f"{TITLES[advice.rank_by]} ({len(advice.ranked)} ranked)", title_justify="left"
    )
    for column in _advice_columns(advice):
        table.add_column(
            column, justify="left" if column in ("layout", "largest overhead") else "right"
        )
    for label, c in zip(advice.rank_labels(top), advice.ranked[:top], strict=True):
        table.add_row(*_advice_row(advice, label, c))
    console.print(table)
    if advice.best is not None:
        tied = sum(1 for c in advice.ranked if advice.ties_best(c))
        console.print(
            f"step times {advice.best.time.range_text()}; {tied} layout(s) within "
            "that of the best rank as ties (=1)",
            markup=False,
        )
        if advice.best.accounting is not None:
            console.print(
                f"the best, the whole run: {advice.best.accounting.summary()}", markup=False
            )
    if advice.own is not None and advice.best is not None:
        console.print(_own_line(advice, advice.own, advice.best), markup=False)
    for kind, items in advice.rejected_by_kind().items():
        if not items:
            continue
        console.print(f"rejected, {kind}: {len(items)}", markup=False)
        for r in items[:3]:
            console.print(f"  {r.layout}: {r.reason}", markup=False)
    console.print(
        f"timed {advice.layouts_timed} layouts ({advice.memory_estimates} memory "
        f"estimates, {advice.validator_calls} validator calls)",
        markup=False,
    )
