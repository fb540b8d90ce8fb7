"""The TP x CP x DP x PP mesh, and `parallelize`: the one place a layout is applied to the
model (CP attention, TP, activation checkpointing, pipeline split, FSDP2, materialisation,
pipeline schedule).

Rank order (innermost first): TP, CP, DP, PP, the order the spec documents and the renderers
place on nodes. TP (a collective in every block, forward and backward, on the critical path)
is consecutive ranks, inside a node; a CP group spans tp x cp consecutive ranks, inside a node
(or an NVLink domain) where it fits; DP reduces gradients once a step and PP sends one
activation per micro-batch and stage, the two that tolerate the slowest links, go outermost.
Inside the CP group the Ulysses index is innermost:
    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index,
    cp_index = ring_index * ulysses + ulysses_index.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch import cp as cp_attention
from ctxlaunch.contract.spec import JobSpec, ModelSpec, StateEngine
from ctxlaunch.cp import comm as cp_comm
from ctxlaunch.runtime.modeling.loss import VocabShard, chunked_cross_entropy
from ctxlaunch.runtime.modeling.model import AttentionFn, Checkpointing, Transformer
from ctxlaunch.runtime.modeling.offload import ActivationOffload
from ctxlaunch.runtime.modeling.weight_sharding import (
    Sharding,
    local_rows,
    shardings,
    write_local,
    write_rows,
)
from ctxlaunch.runtime.parallel.pipeline import StageModule, pipeline_schedule, split_stages
from ctxlaunch.runtime.parallel.tensor_parallel import (
    VocabParallelEmbedding,
    gather_linear,
    gather_sequence,
    scatter_sequence,
    vocab_parallel_token_scores,
)

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule as PipelineSchedule

    from ctxlaunch.runtime.checkpointing.hf import SafetensorsCheckpoint
    from ctxlaunch.runtime.progress import Progress


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    dp: int
    cp: int
    ulysses: int
    cp_sharding: str
    cp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    tp: int = 1
    pp: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None
    """The ranks holding the same weights (same TP and PP index): gradients average here."""

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp % self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    def rank_of(self, *, tp: int, cp: int, dp: int, pp: int) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses


def spec_context(spec: JobSpec, *, rank: int, world_size: int) -> ParallelContext:
    """This rank's place in the spec's DP x CP x TP x PP layout (`build_context` with the
    spec's degrees)."""
    return build_context(
        rank=rank,
        world_size=world_size,
        dp=spec.dp,
        cp=spec.parallel.cp,
        ulysses=spec.ulysses_degree,
        cp_sharding=spec.parallel.cp_sharding,
        tp=spec.parallel.tp,
        pp=spec.parallel.pp,
    )


def build_context(
    *,
    rank: int,
    world_size: int,
    dp: int,
    cp: int,
    ulysses: int,
    cp_sharding: str,
    tp: int = 1,
    pp: int = 1,
) -> ParallelContext:
    """Create the process groups. Every rank creates every group in the same order
    (`new_group` is collective over the whole job) and keeps the ones it belongs to."""
    if tp * cp * dp * pp != world_size:
        raise ValueError(
            f"tp x cp x dp x pp = {tp} x {cp} x {dp} x {pp} must equal the world size {world_size}"
        )
    if cp % ulysses:
        raise ValueError(f"the Ulysses degree {ulysses} must divide cp = {cp}")
    ring = cp // ulysses
    mine: dict[str, dist.ProcessGroup | None] = dict.fromkeys(
        ("tp", "cp", "dp", "pp", "dp_cp", "ulysses", "ring")
    )

    def at(t: int, c: int, d: int, p: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    def make(name: str, ranks: list[int]) -> None:
        if world_size == 1 or len(ranks) == 1:
            return
        group = cp_comm.new_group(ranks)
        if rank in ranks:
            mine[name] = group

    # Group creation order is part of the protocol: every rank runs these same loops.
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                make("tp", [at(t, c, d, p) for t in range(tp)])
    for p in range(pp):
        for t in range(tp):
            for d in range(dp):
                make("cp", [at(t, c, d, p) for c in range(cp)])
            for c in range(cp):
                make("dp", [at(t, c, d, p) for d in range(dp)])
            if dp > 1 and cp > 1:
                make("dp_cp", [at(t, c, d, p) for d in range(dp) for c in range(cp)])
            if 1 < ulysses < cp:
                for d in range(dp):
                    for r in range(ring):
                        make("ulysses", [at(t, r * ulysses + u, d, p) for u in range(ulysses)])
                    for u in range(ulysses):
                        make("ring", [at(t, r * ulysses + u, d, p) for r in range(ring)])
    for t in range(tp):
        for d in range(dp):
            for c in range(cp):
                make("pp", [at(t, c, d, p) for p in range(pp)])
    dp_cp = mine["dp_cp"] or (mine["cp"] if dp == 1 else mine["dp"])
    return ParallelContext(
        rank=rank,
        world_size=world_size,
        dp=dp,
        cp=cp,
        ulysses=ulysses,
        cp_sharding=cp_sharding,
        cp_group=mine["cp"],
        dp_group=mine["dp"],
        ulysses_group=mine["ulysses"],
        ring_group=mine["ring"],
        tp=tp,
        pp=pp,
        tp_group=mine["tp"],
        pp_group=mine["pp"],
        dp_cp_group=dp_cp,
    )


def attention_for(
    ctx: ParallelContext, algorithm: str, tile_tokens: int | None = None
) -> AttentionFn:
    """The attention the layout calls for, bound to this rank's groups (a ring's backward
    over tiles of `tile_tokens`, training.attention_tile_tokens)."""
    if ctx.cp == 1:
        return partial(cp_attention.full_attention, causal=True)
    if algorithm == "ring" or (algorithm == "hybrid" and ctx.ulysses == 1):
        return partial(
            cp_attention.ring_attention,
            group=ctx.cp_group,
            causal=True,
            sharding=ctx.cp_sharding,
            tile_tokens=tile_tokens,
        )
    if algorithm == "ulysses" or (algorithm == "hybrid" and ctx.ulysses == ctx.cp):
        return partial(
            cp_attention.ulysses_attention,
            group=ctx.cp_group,
            causal=True,
            sharding=ctx.cp_sharding,
        )
    if algorithm == "hybrid":
        assert ctx.ulysses_group is not None and ctx.ring_group is not None  # 1 < ulysses < cp
        return partial(
            cp_attention.hybrid_attention,
            ulysses_group=ctx.ulysses_group,
            ring_group=ctx.ring_group,
            causal=True,
            sharding=ctx.cp_sharding,
            tile_tokens=tile_tokens,
        )
    raise ValueError(f"unknown CP algorithm {algorithm!r}")


@dataclass(frozen=True)
class ParallelSettings:
    """The slices of the spec that `parallelize` reads."""

    cp_algorithm: str
    checkpointing: Checkpointing
    state_engine: StateEngine
    """`JobSpec.state_engine`: FSDP2 wraps the parts only for "fsdp2"."""
    zero_stage: int
    stage_layers: tuple[int, ...]
    seq_len: int
    micro_batch: int
    n_micro: int
    """Micro-batches per step (the gradient accumulation): the pipeline schedule's count."""
    seed: int
    bf16: bool = False
    """`model.dtype` is bf16: FSDP2 gathers bf16 parameters (fp32 masters sharded)."""
    init_from: ModelSpec | None = None
    """The model section when it names a Hugging Face checkpoint (`model.init_from`): the
    initial weights are read from it instead of drawn."""
    mlp_tile_tokens: int | None = None
    """training.mlp_tile_tokens: the feed-forward over tiles of this many tokens."""
    attention_tile_tokens: int | None = None
    """training.attention_tile_tokens: the ring attention's backward over tiles."""
    offload_states: bool = False
    """training.offload.optimizer under FSDP2: its CPU offload policy (the sharded parameters,
    their gradients and the optimizer's states in host memory)."""
    offload_activations: bool = False
    """training.offload.activations: the blocks' checkpointed inputs in host memory."""

    @classmethod
    def from_spec(cls, spec: JobSpec) -> ParallelSettings:
        t = spec.training
        return cls(
            mlp_tile_tokens=t.mlp_tile_tokens,
            attention_tile_tokens=t.attention_tile_tokens,
            offload_states=t.offload.optimizer and spec.state_engine == "fsdp2",
            offload_activations=t.offload.activations,
            cp_algorithm=spec.parallel.cp_algorithm,
            checkpointing=t.activation_checkpointing,
            state_engine=spec.state_engine,
            zero_stage=t.zero_stage,
            stage_layers=spec.stage_layers,
            seq_len=t.seq_len,
            micro_batch=t.micro_batch,
            n_micro=spec.grad_accum,
            seed=t.seed,
            bf16=spec.model.dtype == "bf16",
            init_from=spec.model if spec.model.init_from else None,
        )


@dataclass(frozen=True)
class ModelParts:
    """What an engine trains: this rank's modules, materialised, and how to run them."""

    model: Transformer
    """The whole model's shell: its loss; blocks other pipeline ranks hold are Identity."""
    parts: list[nn.Module]
    """The modules this rank runs: `[model]`, or its pipeline stages (`StageModule`s)."""
    schedule: PipelineSchedule | None
    """The pipeline schedule (PP > 1), else None: a plain forward and backward per
    micro-batch."""
    plan: dict[str, Sharding | None]
    """TP sharding of every parameter, by its name in the whole model."""
    sharded: bool
    """FSDP2 shards the parts' states over DP x CP."""

    first: bool
    """This rank runs the first stage: it feeds the token ids."""
    last: bool
    """This rank runs the last stage: it computes the loss."""
    activation_offload: ActivationOffload | None = None
    """The blocks' checkpointed inputs in host memory (training.offload.activations)."""
    states_on_host: bool = False
    """FSDP2 keeps the sharded parameters, gradients and optimizer states in host memory."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the whole model, parameter) for every parameter this rank holds."""
        return [(name, p) for part in self.parts for name, p in part.named_parameters()]


def parallelize(
    model: Transformer, *, ctx: ParallelContext, settings: ParallelSettings, device: torch.device
) -> ModelParts:
    """Apply the layout to a model built on the meta device, in order: CP attention, TP,
    activation checkpointing, the pipeline split, FSDP2; then materialise what this rank
    holds and build the pipeline schedule.

    Materialising allocates only this rank's share: its stages' modules, their TP slice, and
    under FSDP2 its DP x CP shard of that. Transient, one parameter at a time: the whole
    parameter's initial value on the CPU (`Transformer.initial_value`, seeded by the
    parameter's name, so every layout starts from the same weights) and its TP slice; or,
    with `model.init_from`, just the rows (and columns) this rank keeps, read from the
    Hugging Face checkpoint (`ctxlaunch.runtime.checkpointing.hf`)."""
    full_shapes = {name: p.shape for name, p in model.named_parameters()}
    attend = attention_for(ctx, settings.cp_algorithm, settings.attention_tile_tokens)
    for block in model.block_modules():
        block.attn.attend = attend
    plan = apply_tensor_parallel(model, ctx)
    model.set_checkpointing(settings.checkpointing)
    model.set_mlp_tiling(settings.mlp_tile_tokens)
    stages = (
        split_stages(model, stage_layers=settings.stage_layers, pp=ctx.pp, pp_rank=ctx.pp_rank)
        if ctx.pp > 1
        else []
    )
    parts: list[nn.Module] = list(stages) or [model]
    sharded = settings.state_engine == "fsdp2" and ctx.dp_cp_group is not None
    states_on_host = sharded and settings.offload_states
    if ctx.dp_cp_group is not None and sharded:
        _fully_shard(
            parts,
            ctx.dp_cp_group,
            device,
            reshard_after_forward=settings.zero_stage == 3,
            bf16=settings.bf16,
            offload=states_on_host,
        )
    # Under FSDP2's CPU offload policy the sharded parameters live in host memory (FSDP2
    # copies each unit's shard to the device to gather it).
    home = torch.device("cpu") if states_on_host else device
    if settings.init_from is not None:
        _materialise_from_hf(parts, full_shapes, plan, ctx, settings.init_from, home)
    else:
        for part in parts:
            _materialise(part, model, full_shapes, plan, ctx, settings.seed, home)
    activation_offload = None
    if settings.offload_activations:
        blocks = model.block_modules()
        activation_offload = ActivationOffload(len(blocks), device)
        for slot, block in enumerate(blocks):
            block.offload_input = partial(activation_offload.saving, slot)
    schedule = None
    n_stages = len(settings.stage_layers)
    if stages:
        tokens = settings.seq_len // ctx.cp
        # Between stages the hidden states are in the residual stream's dtype: bf16 where
        # FSDP2 gathers bf16 parameters, else fp32 (autocast keeps an fp32 residual).
        schedule = pipeline_schedule(
            model,
            stages,
            n_stages=n_stages,
            group=ctx.pp_group,
            device=device,
            micro_batch=settings.micro_batch,
            tokens=tokens,
            sp_tokens=tokens // ctx.tp,
            n_micro=settings.n_micro,
            hidden_dtype=torch.bfloat16 if sharded and settings.bf16 else torch.float32,
            shard_gradients=sharded and settings.zero_stage >= 2,
            reshard_after_backward=settings.zero_stage == 3,
        )
    return ModelParts(
        model=model,
        parts=parts,
        schedule=schedule,
        plan=plan,
        sharded=sharded,
        first=not stages or stages[0].stage_index == 0,
        last=not stages or stages[-1].stage_index == n_stages - 1,
        activation_offload=activation_offload,
        states_on_host=states_on_host,
    )


def _fully_shard(
    parts: list[nn.Module],
    dp_cp_group: dist.ProcessGroup,
    device: torch.device,
    *,
    reshard_after_forward: bool,
    bf16: bool,
    offload: bool = False,
) -> None:
    """FSDP2 over the ranks holding the same slice (DP x CP), each block a unit. ZeRO-1/2
    keep the gathered weights from forward to backward (gradients and optimizer states
    sharded), ZeRO-3 re-shards them after forward. In bf16 the mixed-precision policy gathers
    bf16 copies of the fp32 shards, which stay the optimizer's master weights, and reduces
    gradients in fp32: no fp32 weight enters the compute, so autocast copies none and the
    residual stream is bf16 (`Layout.fsdp_bf16_params`). With `offload`, FSDP2's CPU offload
    policy keeps the shards, their gradients and so the optimizer's states in host memory
    (pinned on CUDA; torch cannot pin without an accelerator)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = DeviceMesh.from_group(dp_cp_group, device.type)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    offload_policy = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    )
    for part in parts:
        blocks = (
            part.block_list
            if isinstance(part, StageModule)
            else (part.block_modules() if isinstance(part, Transformer) else [])
        )
        for block in blocks:
            fully_shard(
                block,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=policy,
                offload_policy=offload_policy,
            )
        # The root's weights (embedding, final norm, head) stay gathered through backward: the
        # loss uses the head after the stage's forward returns.
        fully_shard(
            part,
            mesh=mesh,
            reshard_after_forward=False,
            mp_policy=policy,
            offload_policy=offload_policy,
        )


def _materialise(
    part: nn.Module,
    model: Transformer,
    full_shapes: dict[str, torch.Size],
    plan: dict[str, Sharding | None],
    ctx: ParallelContext,
    seed: int,
    device: torch.device,
) -> None:
    """Allocate `part`'s parameters on `device` and write each its initial value's slice."""
    part.to_empty(device=device)
    with torch.no_grad():
        for name, param in part.named_parameters():
            value = model.initial_value(name, full_shapes[name], seed)
            sharding = plan[name]
            if sharding is not None and ctx.tp > 1:
                value = sharding.shard(value, ctx.tp, ctx.tp_rank)
            write_local(param, value)


def _materialise_from_hf(
    parts: list[nn.Module],
    full_shapes: dict[str, torch.Size],
    plan: dict[str, Sharding | None],
    ctx: ParallelContext,
    model: ModelSpec,
    device: torch.device,
) -> None:
    """Allocate the parts' parameters and read each one's value from the Hugging Face
    checkpoint: only this rank's TP slice, FSDP chunk and pipeline stages. Rank 0 reports the
    tensors read on stderr (a line each tenth of the way in a log; runtime/progress.py)."""
    from ctxlaunch.runtime.checkpointing import hf
    from ctxlaunch.runtime.progress import Progress

    assert model.init_from is not None  # settings.init_from is set only with it
    checkpoint = hf.SafetensorsCheckpoint(model.init_from)
    hf.check_shapes(checkpoint, full_shapes, model)
    tensors = sum(1 for part in parts for _ in part.parameters())
    with (
        Progress(f"init_from {model.init_from}: parameters loaded", total=tensors)
        if ctx.rank == 0
        else contextlib.nullcontext()
    ) as progress:
        _read_from_hf(parts, full_shapes, plan, ctx, model, checkpoint, device, progress)


def _read_from_hf(
    parts: list[nn.Module],
    full_shapes: dict[str, torch.Size],
    plan: dict[str, Sharding | None],
    ctx: ParallelContext,
    model: ModelSpec,
    checkpoint: SafetensorsCheckpoint,
    device: torch.device,
    progress: Progress | None,
) -> None:
    """`_materialise_from_hf`'s reading, one parameter at a time."""
    from ctxlaunch.runtime.checkpointing import hf

    try:
        for part in parts:
            part.to_empty(device=device)
            with torch.no_grad():
                for name, param in part.named_parameters():
                    sharding = plan[name]
                    tp, tp_rank = (ctx.tp, ctx.tp_rank) if sharding is not None else (1, 0)
                    slice_rows = (
                        full_shapes[name][0] // tp
                        if sharding and not sharding.dim
                        else full_shapes[name][0]
                    )
                    rows = local_rows(param, slice_rows)
                    write_rows(
                        param,
                        hf.read_local(
                            checkpoint, model, name, full_shapes[name], sharding, tp, tp_rank, rows
                        ),
                    )
                    if progress is not None:
                        progress.advance(note=name)
    finally:
        checkpoint.close()


def apply_tensor_parallel(model: Transformer, ctx: ParallelContext) -> dict[str, Sharding | None]:
    """Keep this TP rank's slice of every split weight (of a meta model: its shape; of a
    materialised whole one: its values) and install the sequence-parallel collectives.
    Returns the sharding of every parameter, by its name in the whole model."""
    plan = shardings(model)
    if ctx.tp == 1:
        return plan
    group, tp, rank = ctx.tp_group, ctx.tp, ctx.tp_rank
    assert group is not None  # tp > 1
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            sharding = plan[name]
            if sharding is not None:
                owner, leaf = name.rsplit(".", 1)
                local = sharding.shard(param.detach(), tp, rank).clone()
                setattr(model.get_submodule(owner), leaf, nn.Parameter(local))
    enter, leave = partial(gather_sequence, group=group), partial(scatter_sequence, group=group)
    project_in = partial(gather_linear, group=group)
    for block in model.block_modules():
        block.attn.heads //= tp
        block.attn.kv_heads //= tp
        block.attn.project_in, block.attn.exit = project_in, leave
        block.ffn.project_in, block.ffn.exit = project_in, leave
    embedding = model.get_parameter("embed.weight")
    vocab_start = rank * embedding.shape[0]
    model.embed = VocabParallelEmbedding(embedding, vocab_start, group)
    model.enter_loss = enter
    model.chunked_loss = partial(chunked_cross_entropy, vocab=VocabShard(vocab_start, group))
    model.token_scorer = partial(vocab_parallel_token_scores, vocab_start=vocab_start, group=group)
    return plan
