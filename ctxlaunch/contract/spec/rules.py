"""The rules that tie the sections of the job spec together: the parallel layout against the
model, the training step and the cluster. Each rule reads the sections it concerns and the
job's derived degrees (`ParallelDims`), never the whole job, and reports every broken rule at
once, each at the field it concerns, with the value, the rule and a fix.

`spec.JobSpec` runs them when it validates; the planner and the advisor run them on variants
of a job (through `spec.layout_problems` and `cp_problems`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic_core import InitErrorDetails

from ctxlaunch.contract.families.hfconfig import CONFIG_FILE
from ctxlaunch.contract.spec.fields import _problem

if TYPE_CHECKING:
    from ctxlaunch.contract.parallel_dims import ParallelDims
    from ctxlaunch.contract.spec.cluster_section import ClusterSpec
    from ctxlaunch.contract.spec.fabric_section import FabricSpec
    from ctxlaunch.contract.spec.model_section import ModelSpec
    from ctxlaunch.contract.spec.parallel_section import ParallelSpec
    from ctxlaunch.contract.spec.training_section import TrainingSpec


def layout_problems(
    m: ModelSpec, t: TrainingSpec, p: ParallelSpec, c: ClusterSpec, dims: ParallelDims
) -> list[InitErrorDetails]:
    """Every rule that ties the layout to the model and the cluster; all broken ones at once.
    `dims` are the degrees `p` sets on `c` (ParallelDims.from_sections)."""
    out = composition_problems(p, c, dims)
    out.extend(head_split_problems(m, dims))
    out.extend(engine_problems(t, dims))
    out.extend(offload_problems(t, dims))
    out.extend(attention_tile_problems(t, dims))
    fills = dims.world_size == c.world_size
    grad_accum = t.grad_accum_at(dims.dp) if fills else None
    out.extend(pipeline_problems(m, p, grad_accum))
    out.extend(tensor_parallel_problems(m, p, t.seq_len))
    out.extend(expert_problems(m, t, dims))
    out.extend(cp_problems(m, p, t.seq_len))
    if fills:
        out.extend(batch_problems(t, dims))
    if t.data.source == "text" and m.vocab < 256:
        out.append(_problem(("model", "vocab"), m.vocab, "byte-level text data needs vocab >= 256"))
    out.extend(eval_problems(t, p))
    out.extend(target_problems(c))
    return out


def composition_problems(
    p: ParallelSpec, c: ClusterSpec, dims: ParallelDims
) -> list[InitErrorDetails]:
    """TP x PP x CP x DP = nodes x gpus_per_node (EP is folded over DP x CP: it takes no ranks
    of its own)."""
    if dims.world_size == c.world_size:
        return []
    per_replica = dims.ranks_per_replica
    if p.dp is None:
        return [
            _problem(
                ("parallel",),
                {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp},
                f"tp x pp x cp = {per_replica} must divide the GPU count nodes x "
                f"gpus_per_node = {c.nodes} x {c.gpus_per_node} = {c.world_size} (dp is "
                "derived as the quotient); fix: change a degree or the node count",
            )
        ]
    return [
        _problem(
            ("parallel", "dp"),
            p.dp,
            f"tp x pp x cp x dp = {dims.tp} x {dims.pp} x {dims.cp} x {p.dp} = "
            f"{per_replica * p.dp}, but nodes x gpus_per_node = {c.world_size}; fix: make "
            "them equal, or omit dp to derive it",
        )
    ]


def expert_problems(m: ModelSpec, t: TrainingSpec, dims: ParallelDims) -> list[InitErrorDetails]:
    """Expert parallelism borrows its ranks from DP x CP and splits every layer's experts
    evenly; a mixture-of-experts model trains with what its router needs."""
    out: list[InitErrorDetails] = []
    if m.moe is None:
        if dims.ep > 1:
            out.append(
                _problem(
                    ("parallel", "ep"),
                    dims.ep,
                    f"ep > 1 splits the experts of a mixture-of-experts model, but model.family "
                    f"{m.family} is dense; fix: ep: 1",
                )
            )
        return out
    if dims.shard_group % dims.ep:
        out.append(
            _problem(
                ("parallel", "ep"),
                dims.ep,
                f"ep = {dims.ep} must divide dp x cp = {dims.dp} x {dims.cp} = "
                f"{dims.shard_group}: expert parallelism is folded over the DP x CP ranks and "
                "takes none of its own; fix: an ep that divides it",
            )
        )
    if m.moe.experts % dims.ep:
        out.append(
            _problem(
                ("parallel", "ep"),
                dims.ep,
                f"ep = {dims.ep} must divide model.moe.experts = {m.moe.experts} (each EP rank "
                "holds the same number of experts)",
            )
        )
    if t.mlp_tile_tokens:
        out.append(
            _problem(
                ("training", "mlp_tile_tokens"),
                t.mlp_tile_tokens,
                "the tiled feed-forward recomputes a dense SwiGLU tile by tile, and this "
                "model's feed-forward is a mixture of experts; fix: remove mlp_tile_tokens",
            )
        )
    if t.engine == "deepspeed" and dims.ep > 1 and t.zero_stage == 3:
        out.append(
            _problem(
                ("training", "zero_stage"),
                t.zero_stage,
                f"engine deepspeed shards experts (ep = {dims.ep}) at ZeRO-1 and ZeRO-2 only: "
                "its ZeRO-3 takes experts only inside its own AutoEP layer (its own router and "
                "dispatch); fix: zero_stage: 1 or 2, or engine: fsdp2",
            )
        )
    if t.engine == "deepspeed" and dims.ep > 1 and t.offload.optimizer:
        out.append(
            _problem(
                ("training", "offload", "optimizer"),
                t.offload.optimizer,
                f"engine deepspeed at ep = {dims.ep} keeps the optimizer states on the device "
                "(ZeRO-Offload with experts is neither checked against one process in the "
                "tests nor planned in host memory); fix: offload.optimizer: false, or engine: "
                "fsdp2",
            )
        )
    return out


def head_split_problems(m: ModelSpec, dims: ParallelDims) -> list[InitErrorDetails]:
    """TP hands each rank whole query and whole K/V heads."""
    out: list[InitErrorDetails] = []
    if m.heads % dims.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                dims.tp,
                f"model.heads = {m.heads} must be divisible by tp = {dims.tp}",
            )
        )
    if m.kv_heads % dims.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                dims.tp,
                f"model.kv_heads = {m.kv_heads} must be divisible by tp = {dims.tp} (each TP "
                "rank needs whole K/V heads)",
            )
        )
    return out


def engine_problems(t: TrainingSpec, dims: ParallelDims) -> list[InitErrorDetails]:
    """DeepSpeed ZeRO shards whole-model states, at ZeRO stage 1 and above."""
    out: list[InitErrorDetails] = []
    if t.engine == "deepspeed" and (dims.tp > 1 or dims.pp > 1):
        out.append(
            _problem(
                ("training", "engine"),
                t.engine,
                f"engine deepspeed shards whole-model states and knows nothing of TP slices or "
                f"pipeline stages, but tp = {dims.tp}, pp = {dims.pp}; fix: engine: fsdp2 (or "
                "auto), or tp: 1 and pp: 1",
            )
        )
    if t.engine == "deepspeed" and t.zero_stage == 0:
        out.append(
            _problem(
                ("training", "engine"),
                t.engine,
                "engine deepspeed needs zero_stage >= 1 (ZeRO-0 is plain torch); fix: "
                "zero_stage: 1, 2 or 3, or engine: auto",
            )
        )
    return out


def offload_problems(t: TrainingSpec, dims: ParallelDims) -> list[InitErrorDetails]:
    """What each offload switch (training.offload) needs: an engine that owns the states it
    moves, and for activations the one checkpointing mode whose saved inputs it moves."""
    from ctxlaunch.contract.spec.training_section import resolve_state_engine

    off = t.offload
    out: list[InitErrorDetails] = []
    if off.optimizer and t.zero_stage == 0:
        out.append(
            _problem(
                ("training", "offload", "optimizer"),
                off.optimizer,
                "offloading the optimizer needs an engine that owns its states (DeepSpeed "
                "ZeRO-Offload or FSDP2's CPU offload policy), but zero_stage is 0 (plain "
                "torch); fix: zero_stage: 1, 2 or 3",
            )
        )
    if off.parameters and (t.zero_stage != 3 or not off.optimizer):
        out.append(
            _problem(
                ("training", "offload", "parameters"),
                off.parameters,
                f"offloading the parameters needs zero_stage 3 (the parameters partitioned) "
                f"and offload.optimizer true (their master copies on the host too), but "
                f"zero_stage is {t.zero_stage} and offload.optimizer is "
                f"{str(off.optimizer).lower()}; fix: zero_stage: 3 and offload.optimizer: true",
            )
        )
    engine = resolve_state_engine(t.engine, t.zero_stage, tp=dims.tp, pp=dims.pp, ep=dims.ep)
    if (off.optimizer or off.parameters) and engine == "fsdp2" and dims.dp * dims.cp == 1:
        out.append(
            _problem(
                ("training", "offload", "optimizer"),
                off.optimizer,
                "FSDP2's CPU offload policy needs states sharded over more than one rank, but "
                "dp x cp = 1 (the trainer keeps plain torch states there); fix: engine: "
                "deepspeed with tp 1 and pp 1, or more DP or CP ranks",
            )
        )
    if off.activations and t.activation_checkpointing != "full":
        out.append(
            _problem(
                ("training", "offload", "activations"),
                off.activations,
                f"offloading activations moves each block's checkpointed input, which only "
                f"full checkpointing keeps alone, but activation_checkpointing is "
                f"{t.activation_checkpointing}; fix: activation_checkpointing: full",
            )
        )
    if off.activations and dims.pp > 1:
        out.append(
            _problem(
                ("training", "offload", "activations"),
                off.activations,
                f"offloading activations brings each block's input back in the order of one "
                f"micro-batch's backward, but pp = {dims.pp} interleaves micro-batches; fix: "
                "pp: 1 (CP or ZeRO-3 for the memory instead)",
            )
        )
    return out


def attention_tile_problems(t: TrainingSpec, dims: ParallelDims) -> list[InitErrorDetails]:
    """training.attention_tile_tokens tiles the ring's backward: it needs a ring."""
    if not t.attention_tile_tokens or dims.ring_degree > 1:
        return []
    return [
        _problem(
            ("training", "attention_tile_tokens"),
            t.attention_tile_tokens,
            f"attention tiles split the ring attention's backward, but this layout has no ring "
            f"(cp {dims.cp}, ring degree {dims.ring_degree}); fix: remove attention_tile_tokens, or "
            "cp_algorithm ring or hybrid with a ring degree above 1",
        )
    ]


def batch_problems(t: TrainingSpec, dims: ParallelDims) -> list[InitErrorDetails]:
    """global_batch is a whole number of micro_batch x dp, and agrees with grad_accum. Asked
    only when the degrees fill the GPUs (dp means nothing otherwise)."""
    if t.global_batch is None:
        return []
    dp = dims.dp
    per_step = t.micro_batch * dp
    if t.global_batch % per_step:
        return [
            _problem(
                ("training", "global_batch"),
                t.global_batch,
                f"global_batch must be a multiple of micro_batch x dp = {t.micro_batch} x {dp} "
                f"= {per_step}; fix: global_batch = {_round_up(t.global_batch, per_step)}",
            )
        ]
    if t.grad_accum is not None and t.grad_accum * per_step != t.global_batch:
        return [
            _problem(
                ("training", "grad_accum"),
                t.grad_accum,
                f"grad_accum = {t.grad_accum} disagrees with global_batch / (micro_batch x dp) "
                f"= {t.global_batch // per_step}; fix: give only one of them",
            )
        ]
    return []


def target_problems(c: ClusterSpec) -> list[InitErrorDetails]:
    """What each target needs of the cluster section."""
    out: list[InitErrorDetails] = []
    if c.target == "local" and c.nodes != 1:
        out.append(
            _problem(
                ("cluster", "nodes"), c.nodes, "target local runs on this machine: nodes must be 1"
            )
        )
    if c.target == "kubernetes" and not c.kubernetes.image:
        out.append(
            _problem(
                ("cluster", "kubernetes", "image"),
                None,
                "target kubernetes needs an image with ctxlaunch installed",
            )
        )
    return out


def profile_problems(c: ClusterSpec, fabric: FabricSpec) -> list[InitErrorDetails]:
    """A machine profile was measured over one fabric: the job's must be the same."""
    measured_over = c.profile_fabric
    if measured_over is None or measured_over == fabric.network:
        return []
    return [
        _problem(
            ("cluster", "profile"),
            c.profile,
            f"{c.profile} was measured over fabric {measured_over!r}, but "
            f"fabric.network is {fabric.network!r}; fix: calibrate this cluster or "
            "name its profile",
        )
    ]


def eval_problems(t: TrainingSpec, p: ParallelSpec) -> list[InitErrorDetails]:
    """Evaluation runs forward only, on the job's layout, without a pipeline schedule."""
    out: list[InitErrorDetails] = []
    e = t.eval
    if e.interval and p.pp > 1:
        out.append(
            _problem(
                ("training", "eval", "interval"),
                e.interval,
                f"evaluation during training needs pp = 1 (it runs forward only, with no pipeline "
                f"schedule), but pp = {p.pp}; fix: interval: 0, and run `ctxlaunch eval` on the "
                "checkpoint with --set parallel.pp=1 (checkpoints load at any layout)",
            )
        )
    for i, length in enumerate(e.passkey.lengths or []):
        if length > t.seq_len:
            out.append(
                _problem(
                    ("training", "eval", "passkey", "lengths", i),
                    length,
                    f"a passkey prompt of {length} tokens does not fit in training.seq_len = "
                    f"{t.seq_len}; fix: at most {t.seq_len}",
                )
            )
    return out


def pipeline_problems(
    m: ModelSpec, p: ParallelSpec, grad_accum: int | None
) -> list[InitErrorDetails]:
    """Stages: at least one block each, an explicit split that adds up, and enough
    micro-batches to fill the schedule."""
    out: list[InitErrorDetails] = []
    stages = p.pp * p.virtual_stages
    if p.virtual_stages > 1 and p.pp == 1:
        out.append(
            _problem(
                ("parallel", "virtual_stages"),
                p.virtual_stages,
                "virtual_stages > 1 interleaves pipeline stages and needs pp > 1; fix: "
                "virtual_stages: 1",
            )
        )
    if p.stage_layers is not None:
        if len(p.stage_layers) != stages:
            out.append(
                _problem(
                    ("parallel", "stage_layers"),
                    p.stage_layers,
                    f"stage_layers has {len(p.stage_layers)} entries but there are pp x "
                    f"virtual_stages = {p.pp} x {p.virtual_stages} = {stages} stages; fix: one "
                    "entry per stage, or omit it for a balanced split",
                )
            )
        elif sum(p.stage_layers) != m.layers:
            out.append(
                _problem(
                    ("parallel", "stage_layers"),
                    p.stage_layers,
                    f"stage_layers sum to {sum(p.stage_layers)} but model.layers = {m.layers}; "
                    "fix: make them add up, or omit stage_layers for a balanced split",
                )
            )
    elif m.layers < stages:
        out.append(
            _problem(
                ("parallel", "pp"),
                p.pp,
                f"model.layers = {m.layers} cannot fill pp x virtual_stages = {stages} stages "
                "with at least one block each; fix: fewer stages",
            )
        )
    if p.pp > 1 and m.tie_embeddings:
        out.append(
            _problem(
                ("model", "tie_embeddings"),
                True,
                "tied embeddings put one weight on the first and the last pipeline stage; the "
                "trainer does not synchronise it across stages; fix: tie_embeddings: false or pp: 1",
            )
        )
    if p.pp > 1 and grad_accum is not None and 0 < grad_accum < p.pp:
        out.append(
            _problem(
                ("training", "grad_accum"),
                grad_accum,
                f"the pipeline runs the step's {grad_accum} micro-batches (grad_accum) through "
                f"pp = {p.pp} stages; 1F1B needs at least one per stage; fix: grad_accum (or "
                f"global_batch / (micro_batch x dp)) >= {p.pp}",
            )
        )
    elif p.virtual_stages > 1 and grad_accum is not None and grad_accum % p.pp:
        out.append(
            _problem(
                ("training", "grad_accum"),
                grad_accum,
                f"interleaved 1F1B runs the step's {grad_accum} micro-batches (grad_accum) in "
                f"rounds of pp = {p.pp}; fix: grad_accum (or global_batch) a multiple of {p.pp}",
            )
        )
    return out


def tensor_parallel_problems(m: ModelSpec, p: ParallelSpec, seq_len: int) -> list[InitErrorDetails]:
    """TP splits heads, the SwiGLU width and the vocabulary; sequence parallelism splits each
    CP rank's tokens."""
    out: list[InitErrorDetails] = []
    if p.tp == 1:
        return out
    if m.ffn_hidden % p.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                p.tp,
                f"model.ffn_hidden = {m.ffn_hidden} must be divisible by tp = {p.tp} (the SwiGLU "
                "width is split over the TP ranks)",
            )
        )
    if m.vocab % p.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                p.tp,
                f"model.vocab = {m.vocab} must be divisible by tp = {p.tp} (the embedding and the "
                "output head are split by vocabulary)",
            )
        )
    if seq_len % (p.cp * p.tp):
        out.append(
            _problem(
                ("training", "seq_len"),
                seq_len,
                f"sequence parallelism splits each CP rank's seq_len / cp tokens over tp = {p.tp} "
                f"ranks: seq_len must be divisible by cp x tp = {p.cp * p.tp}; fix: seq_len = "
                f"{_round_up(seq_len, p.cp * p.tp)}",
            )
        )
    return out


def cp_problems(m: ModelSpec, p: ParallelSpec, seq_len: int) -> list[InitErrorDetails]:
    """The rules a CP degree, algorithm and sharding must meet for this model and sequence."""
    out: list[InitErrorDetails] = []
    # Sequence divisibility, caught here instead of at run time. Hybrid and Ulysses shard the
    # same way as the ring: a CP sharding means the same token placement whatever the algorithm.
    if p.cp > 1:
        if p.cp_sharding in ("zigzag", "balanced") and seq_len % (2 * p.cp):
            out.append(
                _problem(
                    ("training", "seq_len"),
                    seq_len,
                    f"cp_sharding {p.cp_sharding} with cp = {p.cp} needs seq_len divisible by "
                    f"2 x cp = {2 * p.cp} (each rank holds chunks i and 2N-1-i of 2N); fix: "
                    f"seq_len = {_round_up(seq_len, 2 * p.cp)}",
                )
            )
        if p.cp_sharding == "contiguous" and seq_len % p.cp:
            out.append(
                _problem(
                    ("training", "seq_len"),
                    seq_len,
                    f"cp_sharding contiguous with cp = {p.cp} needs seq_len divisible by cp; fix: "
                    f"seq_len = {_round_up(seq_len, p.cp)}",
                )
            )
    heads_per_tp, kv_per_tp = m.heads // p.tp or 1, m.kv_heads // p.tp or 1
    if p.cp_algorithm != "hybrid" and (p.ulysses_degree is not None or p.ring_degree is not None):
        field = "ulysses_degree" if p.ulysses_degree is not None else "ring_degree"
        out.append(
            _problem(
                ("parallel", field),
                getattr(p, field),
                f"{field} applies to cp_algorithm hybrid only (this spec uses {p.cp_algorithm}); "
                "fix: remove it, or use cp_algorithm: hybrid",
            )
        )
    if p.cp_algorithm == "ulysses":
        out.extend(
            _ulysses_problems(("parallel", "cp"), p.cp, heads_per_tp, kv_per_tp, p.cp, hybrid=False)
        )
    elif p.cp_algorithm == "hybrid":
        if p.ulysses_degree is None:
            out.append(
                _problem(
                    ("parallel", "ulysses_degree"),
                    None,
                    "cp_algorithm hybrid needs ulysses_degree (the inner, all-to-all degree); "
                    f"the ring degree is cp / ulysses_degree; e.g. ulysses_degree: "
                    f"{_largest_common_divisor_at_most((p.cp, heads_per_tp, kv_per_tp), p.cp)}",
                )
            )
        else:
            u = p.ulysses_degree
            if p.cp % u:
                out.append(
                    _problem(
                        ("parallel", "ulysses_degree"),
                        u,
                        f"hybrid degrees multiply to cp: ulysses_degree = {u} must divide cp = "
                        f"{p.cp}",
                    )
                )
            elif p.ring_degree is not None and p.ring_degree * u != p.cp:
                out.append(
                    _problem(
                        ("parallel", "ring_degree"),
                        p.ring_degree,
                        f"hybrid degrees multiply to cp: ulysses_degree x ring_degree = {u} x "
                        f"{p.ring_degree} = {u * p.ring_degree}, but cp = {p.cp}",
                    )
                )
            out.extend(
                _ulysses_problems(
                    ("parallel", "ulysses_degree"), u, heads_per_tp, kv_per_tp, p.cp, hybrid=True
                )
            )
    return out


def _ulysses_problems(
    loc: tuple[str, ...], degree: int, heads: int, kv_heads: int, cp: int, *, hybrid: bool
) -> list[InitErrorDetails]:
    out = []
    best = _largest_common_divisor_at_most((cp, heads, kv_heads), kv_heads)
    if hybrid:
        fix = f"ulysses_degree: {best} (ring degree {cp // best})"
    elif best > 1:
        fix = (
            f"use cp_algorithm: hybrid with ulysses_degree: {best} (ring degree "
            f"{cp // best}), so Ulysses stays within the K/V heads and a ring covers the rest"
        )
    else:
        fix = "use cp_algorithm: ring"
    if heads % degree:
        out.append(
            _problem(
                loc,
                degree,
                f"the Ulysses degree {degree} must divide the query heads per TP rank ({heads}): "
                f"the all-to-all hands each rank whole heads; fix: {fix}",
            )
        )
    if degree > kv_heads or kv_heads % degree:
        out.append(
            _problem(
                loc,
                degree,
                f"the Ulysses degree {degree} "
                + (
                    f"exceeds the K/V heads per TP rank ({kv_heads})"
                    if degree > kv_heads
                    else f"does not divide the K/V heads per TP rank ({kv_heads})"
                )
                + f": each rank must receive whole K/V heads; fix: {fix}",
            )
        )
    return out


def layout_warnings(
    m: ModelSpec,
    t: TrainingSpec,
    p: ParallelSpec,
    c: ClusterSpec,
    dims: ParallelDims,
    nvlink_domain: int,
) -> list[str]:
    """Legal but poor choices, worth a second look (not errors). `nvlink_domain` is the GPUs
    per NVLink domain the job runs with (the fabric's, or the GPU type's)."""
    gpu = c.gpu_info
    out = []
    cp_span = dims.tp * dims.cp  # consecutive ranks one CP group (with its TP ranks) covers
    if dims.cp > 1 and c.gpu != "cpu" and not gpu.nvlink:
        out.append(
            f"parallel.cp = {dims.cp} on {c.gpu}, a PCIe-only GPU: every K/V transfer crosses "
            "the PCIe bus (and the network beyond a node); expect CP to be communication-bound. "
            "Prefer fewer, larger-memory GPUs per CP group, or Ulysses to send less."
        )
    elif dims.cp > 1 and c.gpu != "cpu" and cp_span > nvlink_domain:
        out.append(
            f"the CP group (tp x cp = {cp_span} ranks) spans beyond the NVLink domain "
            f"({nvlink_domain} GPUs): K/V traffic crosses the inter-node network."
        )
    if dims.cp > 1 and p.cp_algorithm == "ring" and cp_span > c.gpus_per_node and c.nodes > 1:
        kv_per_tp = max(m.kv_heads // dims.tp, 1)
        heads_per_tp = max(m.heads // dims.tp, 1)
        inner = _largest_common_divisor_at_most(
            (dims.cp, heads_per_tp, kv_per_tp), c.gpus_per_node // dims.tp
        )
        if inner > 1:
            out.append(
                f"the ring CP group ({dims.cp} ranks) is wider than a node ({c.gpus_per_node} "
                f"GPUs) while Ulysses would fit in one: consider cp_algorithm: hybrid with "
                f"ulysses_degree: {inner} (all-to-all inside the node, ring of "
                f"{dims.cp // inner} across nodes)."
            )
    out += p.deprecations
    if p.cp_sharding == "contiguous" and dims.cp > 1:
        out.append(
            "cp_sharding contiguous with causal attention leaves CP ranks unbalanced (rank N-1 "
            "does N times rank 0's work); zigzag balances it."
        )
    masked_ring = dims.cp > 1 and p.cp_algorithm != "ulysses" and t.data.document_mask
    if masked_ring and p.cp_sharding != "balanced":
        out.append(
            f"cp_sharding {p.cp_sharding} under a document mask leaves the ring's CP ranks "
            "unbalanced (the busiest does 1.3-3x the mean attention area on packed documents); "
            "cp_sharding: balanced places each sequence's documents so every rank does the same."
        )
    if p.cp_sharding == "balanced" and dims.cp > 1 and not t.data.document_mask:
        out.append(
            "cp_sharding balanced without training.data.document_mask is zigzag (it balances "
            "the document mask's area; the plain causal triangle zigzag already balances)."
        )
    out += [
        f"{missing} on this machine; the trainer needs it where it runs"
        for missing in t.data.missing_files()
    ]
    if m.init_from is not None and not (Path(m.init_from) / CONFIG_FILE).is_file():
        out.append(
            f"model.init_from {m.init_from}: no {CONFIG_FILE} on this machine; the shape "
            "the spec gives is used here, and the trainer checks it against the "
            "checkpoint where it runs"
        )
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _largest_common_divisor_at_most(values: tuple[int, ...], limit: int) -> int:
    """The largest d <= limit dividing every value (at least 1)."""
    for d in range(max(min(limit, *values), 1), 0, -1):
        if all(v % d == 0 for v in values):
            return d
    return 1
