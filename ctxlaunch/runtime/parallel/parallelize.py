"""`parallelize`: the one place a layout is applied to the model, in order (CP attention, TP,
activation checkpointing, the pipeline split, FSDP2, materialisation, the pipeline schedule).
It reads the planner's own record of the job (`perf.layout.Layout`, with the job's one
`ParallelDims`) and this rank's context (`context.py`), so what runs is what was planned.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch.contract.families import FAMILIES
from ctxlaunch.contract.spec import JobSpec, ModelSpec
from ctxlaunch.perf.layout import Layout
from ctxlaunch.runtime.modeling.loss import VocabShard, chunked_cross_entropy
from ctxlaunch.runtime.modeling.model import FeedForward, Transformer
from ctxlaunch.runtime.modeling.moe import MoEFeedForward
from ctxlaunch.runtime.modeling.offload import ActivationOffload
from ctxlaunch.runtime.modeling.weight_sharding import (
    Sharding,
    local_rows,
    shardings,
    write_local,
    write_rows,
)
from ctxlaunch.runtime.parallel.context import ParallelContext, attention_for
from ctxlaunch.runtime.parallel.expert_parallel import apply_expert_parallel
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
    """FSDP2 shards the parts' states over DP x CP (expert states over the ranks holding the
    same experts)."""

    first: bool
    """This rank runs the first stage: it feeds the token ids."""
    last: bool
    """This rank runs the last stage: it computes the loss."""
    activation_offload: ActivationOffload | None = None
    """The blocks' checkpointed inputs in host memory (training.offload.activations)."""
    states_on_host: bool = False
    """FSDP2 keeps the sharded parameters, gradients and optimizer states in host memory."""
    experts: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each expert parameter's (first, count) of the experts this rank holds, by its name in
    the whole model (expert parallelism)."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the whole model, parameter) for every parameter this rank holds."""
        return [(name, p) for part in self.parts for name, p in part.named_parameters()]


def parallelize(
    model: Transformer,
    *,
    ctx: ParallelContext,
    layout: Layout,
    device: torch.device,
    seed: int,
    init_from: ModelSpec | None = None,
) -> ModelParts:
    """Apply the layout to a model built on the meta device, in order: CP attention, TP,
    activation checkpointing, the pipeline split, FSDP2; then materialise what this rank
    holds and build the pipeline schedule.

    Materialising allocates only this rank's share: its stages' modules, their TP slice, and
    under FSDP2 its DP x CP shard of that. Transient, one parameter at a time: the whole
    parameter's initial value on the CPU (`Transformer.initial_value`, seeded by the
    parameter's name and `seed`, so every layout starts from the same weights) and its TP
    slice; or, with `init_from` (the model section, when it names a Hugging Face checkpoint),
    just the rows (and columns) this rank keeps, read from the checkpoint
    (`ctxlaunch.runtime.checkpointing.hf`)."""
    full_shapes = {name: p.shape for name, p in model.named_parameters()}
    dims = ctx.dims
    attend = attention_for(ctx, layout.attention_tile_tokens or None)
    for block in model.block_modules():
        block.attn.attend = attend
    plan = apply_tensor_parallel(model, ctx)
    experts = apply_expert_parallel(model, ctx)
    model.set_checkpointing(layout.activation_checkpointing)
    model.set_mlp_tiling(layout.mlp_tile_tokens or None)
    stages = (
        split_stages(model, stage_layers=layout.stage_layers, pp=dims.pp, pp_rank=ctx.pp_rank)
        if dims.pp > 1
        else []
    )
    parts: list[nn.Module] = list(stages) or [model]
    bf16 = layout.dtype == "bf16"
    sharded = layout.fsdp and ctx.dp_cp_group is not None
    states_on_host = sharded and layout.offload_optimizer
    if ctx.dp_cp_group is not None and sharded:
        _fully_shard(
            parts,
            ctx.dp_cp_group,
            ctx.edp_group,
            device,
            reshard_after_forward=layout.zero_stage == 3,
            bf16=bf16,
            offload=states_on_host,
        )
    # Under FSDP2's CPU offload policy the sharded parameters live in host memory (FSDP2
    # copies each unit's shard to the device to gather it).
    home = torch.device("cpu") if states_on_host else device
    if init_from is not None:
        _materialise_from_hf(parts, full_shapes, plan, experts, ctx, init_from, home)
    else:
        for part in parts:
            _materialise(part, model, full_shapes, plan, experts, ctx, seed, home)
    activation_offload = None
    if layout.offload_activations:
        blocks = model.block_modules()
        activation_offload = ActivationOffload(len(blocks), device)
        for slot, block in enumerate(blocks):
            block.offload_input = partial(activation_offload.saving, slot)
    schedule = None
    n_stages = len(layout.stage_layers)
    if stages:
        tokens = layout.seq_len // dims.cp
        # Between stages the hidden states are in the residual stream's dtype: bf16 where
        # FSDP2 gathers bf16 parameters, else fp32 (autocast keeps an fp32 residual).
        schedule = pipeline_schedule(
            model,
            stages,
            n_stages=n_stages,
            group=ctx.pp_group,
            device=device,
            micro_batch=layout.micro_batch,
            tokens=tokens,
            sp_tokens=tokens // dims.tp,
            n_micro=layout.grad_accum,
            hidden_dtype=torch.bfloat16 if sharded and bf16 else torch.float32,
            shard_gradients=sharded and layout.zero_stage >= 2,
            reshard_after_backward=layout.zero_stage == 3,
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
        experts=experts,
    )


def parallelize_job(
    model: Transformer, spec: JobSpec, *, ctx: ParallelContext, device: torch.device
) -> ModelParts:
    """`parallelize` with a validated job's layout (the planner's `Layout.from_spec`), seed and
    Hugging Face checkpoint: what the trainer's and `ctxlaunch eval`'s ranks run."""
    return parallelize(
        model,
        ctx=ctx,
        layout=Layout.from_spec(spec),
        device=device,
        seed=spec.training.seed,
        init_from=spec.model if spec.model.init_from else None,
    )


def _fully_shard(
    parts: list[nn.Module],
    dp_cp_group: dist.ProcessGroup,
    edp_group: dist.ProcessGroup | None,
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
    (pinned on CUDA; torch cannot pin without an accelerator). A mixture-of-experts block's
    experts are a unit of their own over the ranks holding the same experts (`edp_group`),
    or kept whole, out of the block's unit, where this rank alone holds them."""
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
            ignored: set[nn.Parameter] = set()
            if isinstance(block.ffn, MoEFeedForward):
                if edp_group is not None:
                    fully_shard(
                        block.ffn.experts,
                        mesh=DeviceMesh.from_group(edp_group, device.type),
                        reshard_after_forward=reshard_after_forward,
                        mp_policy=policy,
                        offload_policy=offload_policy,
                    )
                else:
                    ignored = set(block.ffn.experts.parameters())
            fully_shard(
                block,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=policy,
                offload_policy=offload_policy,
                ignored_params=ignored or None,
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
    experts: dict[str, tuple[int, int]],
    ctx: ParallelContext,
    seed: int,
    device: torch.device,
) -> None:
    """Allocate `part`'s parameters on `device` and write each its initial value's slice (of an
    expert parameter, this rank's experts')."""
    part.to_empty(device=device)
    with torch.no_grad():
        for name, param in part.named_parameters():
            value = model.initial_value(name, full_shapes[name], seed, experts.get(name))
            sharding = plan[name]
            if sharding is not None and ctx.dims.tp > 1:
                value = sharding.shard(value, ctx.dims.tp, ctx.tp_rank)
            write_local(param, value)


def _materialise_from_hf(
    parts: list[nn.Module],
    full_shapes: dict[str, torch.Size],
    plan: dict[str, Sharding | None],
    experts: dict[str, tuple[int, int]],
    ctx: ParallelContext,
    model: ModelSpec,
    device: torch.device,
) -> None:
    """Allocate the parts' parameters and read each one's value from the Hugging Face
    checkpoint: only this rank's TP slice, FSDP chunk and pipeline stages. Rank 0 reports the
    tensors read on stderr (a line each tenth of the way in a log; runtime/progress.py)."""
    from ctxlaunch.runtime.checkpointing import hf
    from ctxlaunch.runtime.progress import Progress

    assert model.init_from is not None  # parallelize's init_from is given only with it
    checkpoint = hf.SafetensorsCheckpoint(model.init_from, FAMILIES[model.family])
    hf.check_shapes(checkpoint, full_shapes, model)
    tensors = sum(1 for part in parts for _ in part.parameters())
    with (
        Progress(f"init_from {model.init_from}: parameters loaded", total=tensors)
        if ctx.rank == 0
        else contextlib.nullcontext()
    ) as progress:
        _read_from_hf(parts, full_shapes, plan, experts, ctx, model, checkpoint, device, progress)


def _read_from_hf(
    parts: list[nn.Module],
    full_shapes: dict[str, torch.Size],
    plan: dict[str, Sharding | None],
    experts: dict[str, tuple[int, int]],
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
                    tp, tp_rank = (ctx.dims.tp, ctx.tp_rank) if sharding is not None else (1, 0)
                    slice_rows = (
                        full_shapes[name][0] // tp
                        if sharding and not sharding.dim
                        else full_shapes[name][0]
                    )
                    held = experts.get(name)
                    rows = local_rows(param, held[1] if held else slice_rows)
                    write_rows(
                        param,
                        hf.read_local(
                            checkpoint,
                            model,
                            name,
                            full_shapes[name],
                            sharding,
                            tp,
                            tp_rank,
                            rows,
                            held,
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
    if ctx.dims.tp == 1:
        return plan
    group, tp, rank = ctx.tp_group, ctx.dims.tp, ctx.tp_rank
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
        if isinstance(block.ffn, FeedForward):  # a mixture of experts runs on its own tokens
            block.ffn.project_in, block.ffn.exit = project_in, leave
    embedding = model.get_parameter("embed.weight")
    vocab_start = rank * embedding.shape[0]
    model.embed = VocabParallelEmbedding(embedding, vocab_start, group)
    model.enter_loss = enter
    model.chunked_loss = partial(chunked_cross_entropy, vocab=VocabShard(vocab_start, group))
    model.token_scorer = partial(vocab_parallel_token_scores, vocab_start=vocab_start, group=group)
    return plan
