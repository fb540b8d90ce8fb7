"""Model states per rank: the parameters a rank holds, and their weights, gradients and optimizer
states by the engine that runs them, with the engines' communication buffers. Part of the
per-GPU memory model (ctxlaunch.perf.memory); pure arithmetic, no torch.

Model states per parameter held by the rank (the sharding group of ZeRO is DP x CP, since every
CP rank holds a replica of the weights), mirroring how the trainer runs them:
- ZeRO-0 (plain torch; bf16 through autocast): fp32 weights 4 + fp32 gradients 4 + Adam 8 = 16.
- ZeRO-1..3 (DeepSpeed, bf16): 16-bit weights 2, 16-bit gradients 2, and per sharded parameter
  an fp32 gradient 4 + fp32 master 4 + Adam 8. DeepSpeed keeps the fp32 gradient partition the
  ZeRO paper's 2 + 14/Nd leaves out; we follow DeepSpeed's own estimators
  (estimate_zero2/zero3_model_states_mem_needs), which a test checks:
      ZeRO-1: 4 + 16/Nd,  ZeRO-2: 2 + 18/Nd,  ZeRO-3: 18/Nd (+ 4 bytes x the largest layer,
      the gathered parameters)
- fp32 under DeepSpeed: weights 4, gradients 4 (full for ZeRO-1), master copy 4, Adam 8:
      ZeRO-1: 8 + 12/Nd,  ZeRO-2: 4 + 16/Nd,  ZeRO-3: 20/Nd (+ 4 x largest layer)
- FSDP2 (ZeRO >= 1 with TP or PP): fp32 master 4, fp32 gradient 4 and Adam 8, all sharded,
  16/Nd, plus the gathered weights: in bf16 the mixed-precision policy gathers bf16 copies
  (2 per parameter kept through backward under ZeRO 1-2, two blocks' under ZeRO-3), so no
  autocast weight copies are saved and the residual stream is bf16 (`Layout.fsdp_bf16_params`);
  in fp32, 4. In backward each block's gradients are produced unsharded in the gathered dtype
  and copied into an fp32 reduce-scatter input (`fsdp_block_backward_bytes`). Under PP at
  ZeRO-1 torch's pipelining skips FSDP2's gradient sync until after the last micro-batch, so
  the stage's unsharded gradients accumulate in fp32 (4 per parameter) from the first backward
  to the step; at ZeRO-2/3 the trainer reduce-scatters every micro-batch's gradients as FSDP2
  does without PP (runtime/parallel/pipeline.py, trainer_stage), so only the fp32 shards
  accumulate (4/Nd), and ZeRO-3 re-shards the weights after each backward.

Nd above is the sharding group (`Layout.shard_group`). A mixture-of-experts model's routed
experts are split over EP (E / ep a rank, whole on every TP rank) and their states sharded over
the ranks holding the same experts (dp x cp / ep, `ParallelDims.expert_shard_group`): the same
formulas with that group, added to the dense parameters' (ctxlaunch.perf.moecost).

Offloaded (training.offload.optimizer, `Layout.offload_optimizer`), the optimizer states, the
fp32 master weights and the fp32 gradients live in host memory (ctxlaunch.perf.hostmemory);
the device keeps, as DeepSpeed's own estimators state it: ZeRO-1/2 the 16-bit weights 2 (the
gradients pass through the reduce bucket on their way to the host); ZeRO-3 the 16-bit
partition 2/Nd and the gathered largest layer, and with the parameters offloaded too
(`Layout.offload_parameters`) the gathered largest layer alone. FSDP2's CPU offload policy
leaves on the device only what it gathers (the 16-bit copies) and each block's transient
unsharded gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxlaunch.perf.flops import count_params
from ctxlaunch.perf.layout import Layout, default_rank_layers

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec

# Constants the trainer uses too, so the planner and the run agree.
GRAD_BUCKET_ELEMENTS = 25_000_000
"""ZeRO-0: gradients are all-reduced over DP x CP in flat buckets of this many elements."""
ZERO_BUCKET_ELEMENTS = 200_000_000
"""ZeRO-1/2: DeepSpeed reduce_bucket_size and allgather_bucket_size."""
ZERO3_PREFETCH_ELEMENTS = 50_000_000
"""ZeRO-3: DeepSpeed stage3_prefetch_bucket_size."""


# --------------------------------------------------------------------------------------------
# parameters held
# --------------------------------------------------------------------------------------------
def _held_split(
    model: ModelSpec, tp: int, ep: int, blocks: int | None, first: bool, last: bool
) -> tuple[int, int]:
    """(dense parameters split by TP, routed experts' split by EP) of a rank holding `blocks`
    blocks (None: every one) and the embedding (`first`) and final norm and head (`last`). A
    stage's mixture-of-experts blocks are taken in the model's proportion of them."""
    counts = count_params(model)
    if blocks is None:
        blocks, first, last = model.layers, True, True
    sparse = round(blocks * counts.moe_layers / model.layers) if counts.moe_layers else 0
    experts = counts.experts_per_block * sparse
    dense = counts.per_layer * (blocks - sparse) + counts.moe_block * sparse - experts
    dense += (counts.embedding if first else 0) + (counts.final_norm + counts.head if last else 0)
    return -(-dense // tp), -(-experts // ep)


def stage_expert_params(model: ModelSpec, layout: Layout, stage: int | None = None) -> int:
    """Routed experts' parameters PP rank `stage` holds (None: the busiest rank), split by
    EP; 0 for a dense model."""
    if model.moe is None:
        return 0
    d = layout.dims
    if d.pp == 1:
        return _held_split(model, d.tp, d.ep, None, True, True)[1]
    layers = layout.rank_layers(model.layers)
    if stage is None:
        stage = max(range(d.pp), key=lambda r: stage_params(model, layout, r))
    return _held_split(model, d.tp, d.ep, layers[stage], stage == 0, stage == d.pp - 1)[1]


def params_per_rank(
    model: ModelSpec, tp: int, pp: int, rank_layers: list[int] | None = None, ep: int = 1
) -> int:
    """Parameters held by the busiest rank before ZeRO sharding: a pipeline stage's blocks
    (plus the embedding or the head on the end stages) split by TP, a mixture of experts'
    routed experts by EP. `rank_layers`: blocks per PP rank (default: the balanced split the
    validator gives a spec, `default_rank_layers`)."""
    counts = count_params(model)
    if model.moe is not None:
        layers = rank_layers or default_rank_layers(model.layers, pp)
        return max(
            sum(_held_split(model, tp, ep, None if pp == 1 else n, r == 0, r == pp - 1))
            for r, n in enumerate(layers if pp > 1 else [model.layers])
        )
    if pp == 1:
        return -(-counts.total // tp)
    layers = rank_layers or default_rank_layers(model.layers, pp)
    held = [counts.per_layer * blocks for blocks in layers]
    held[0] += counts.embedding
    held[-1] += counts.final_norm + counts.head
    return -(-max(held) // tp)


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Parameters PP rank `stage` holds before ZeRO sharding (its blocks, the embedding on the
    first, the final norm and head on the last), split by TP (routed experts by EP)."""
    if layout.dims.pp == 1:
        return params_per_rank(model, layout.dims.tp, 1, ep=layout.dims.ep)
    if model.moe is not None:
        d = layout.dims
        blocks = layout.rank_layers(model.layers)[stage]
        return sum(_held_split(model, d.tp, d.ep, blocks, stage == 0, stage == d.pp - 1))
    counts = count_params(model)
    held = counts.per_layer * layout.rank_layers(model.layers)[stage]
    if stage == 0:
        held += counts.embedding
    if stage == layout.dims.pp - 1:
        held += counts.final_norm + counts.head
    return -(-held // layout.dims.tp)


def largest_layer_params(model: ModelSpec, tp: int = 1) -> int:
    counts = count_params(model)
    return -(-max(counts.per_layer, counts.moe_block, counts.embedding, counts.head) // tp)


def block_params(model: ModelSpec, layout: Layout) -> float:
    """One block's parameters on a rank (its TP slice; a mixture-of-experts block's experts
    split by EP instead): what FSDP2 gathers and reduces as a unit."""
    counts = count_params(model)
    if model.moe is not None:
        experts = counts.experts_per_block
        return (counts.moe_block - experts) / layout.dims.tp + experts / layout.dims.ep
    return counts.per_layer / layout.dims.tp


# --------------------------------------------------------------------------------------------
# weights, gradients and optimizer states, by engine
# --------------------------------------------------------------------------------------------
def model_state_bytes(
    params: int,
    largest_layer_params: int,
    stage: int,
    shard_group: int,
    dtype: str,
    *,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) bytes per rank on the device; see the module
    docstring."""
    if offload_optimizer and stage >= 1:
        weight = 2 if dtype == "bf16" else 4
        if stage < 3:
            return weight * params, 0, 0
        gathered = 4 * largest_layer_params
        if offload_parameters:
            return gathered, 0, 0
        return weight * params // shard_group + gathered, 0, 0
    if stage == 0:
        return 4 * params, 4 * params, 8 * params
    if dtype == "bf16":
        if stage == 1:
            return 2 * params, 2 * params, 16 * params // shard_group
        if stage == 2:
            return 2 * params, 2 * params // shard_group, 16 * params // shard_group
        return (
            2 * params // shard_group + 4 * largest_layer_params,
            2 * params // shard_group,
            14 * params // shard_group,
        )
    if stage == 1:
        return 4 * params, 4 * params, 12 * params // shard_group
    if stage == 2:
        return 4 * params, 4 * params // shard_group, 12 * params // shard_group
    return (
        4 * params // shard_group + 4 * largest_layer_params,
        4 * params // shard_group,
        12 * params // shard_group,
    )


def fsdp_state_bytes(
    params: int,
    zero3_gathered: int,
    stage: int,
    shard_group: int,
    *,
    param_bytes: int = 4,
    offload: bool = False,
) -> tuple[int, int, int]:
    """FSDP2 over DP x CP (ZeRO >= 1 with TP or PP): fp32 master weights, fp32 gradients and
    Adam states sharded, 16/Nd per parameter; the gathered weights in `param_bytes` per element
    (2 under bf16: the mixed-precision policy gathers bf16 copies of the fp32 shards), every
    block's kept from forward to backward under ZeRO 1-2, under ZeRO-3 `zero3_gathered`
    (`zero3_gathered_params`: two blocks' and the root's)."""
    if shard_group == 1:  # nothing to shard over: the trainer keeps plain fp32 states (ZeRO-0)
        return 4 * params, 4 * params, 8 * params
    gathered = param_bytes * (params if stage < 3 else zero3_gathered)
    if offload:  # the CPU offload policy: the shards, their gradients and Adam on the host
        return gathered, 0, 0
    return (
        4 * params // shard_group + gathered,
        4 * params // shard_group,
        8 * params // shard_group,
    )


def fsdp_param_bytes(layout: Layout) -> int:
    """Bytes per element of FSDP2's gathered (unsharded) parameters and of the gradients
    autograd produces into them before the reduce-scatter."""
    return 2 if layout.fsdp_bf16_params else 4


def zero3_gathered_params(
    model: ModelSpec, layout: Layout, params: int, stage: int | None = None
) -> int:
    """FSDP2 ZeRO-3: the parameters gathered at the peak (a block's backward) on PP rank
    `stage` (None: any, so the embedding and the head both): that block's, the next one's
    (prefetched), and the root module's (embedding; final norm and head), which the trainer
    keeps gathered from its forward through its backward (`reshard_after_forward=False`: the
    loss uses the head after the forward returns); never more than the rank holds."""
    counts = count_params(model)
    first = stage is None or stage == 0
    last = stage is None or stage == layout.dims.pp - 1
    root = (counts.embedding if first else 0) + (counts.final_norm + counts.head if last else 0)
    block = block_params(model, layout) * layout.dims.tp
    return min(params, int(-(-(2 * block + root) // layout.dims.tp)))


def state_bytes(
    model: ModelSpec, layout: Layout, params: int, stage: int | None = None, experts: int = 0
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) bytes of `params` parameters on one rank (PP
    rank `stage`, or any), by the engine the layout runs (FSDP2, DeepSpeed or plain torch); of
    them `experts` routed experts' parameters, sharded over the ranks holding the same
    experts."""
    if experts:
        dense = _engine_state_bytes(model, layout, params - experts, stage, layout.dims.shard_group)
        held = _engine_state_bytes(model, layout, experts, stage, layout.dims.expert_shard_group)
        return dense[0] + held[0], dense[1] + held[1], dense[2] + held[2]
    return _engine_state_bytes(model, layout, params, stage, layout.dims.shard_group)


def _engine_state_bytes(
    model: ModelSpec, layout: Layout, params: int, stage: int | None, shard_group: int
) -> tuple[int, int, int]:
    if layout.fsdp:
        return fsdp_state_bytes(
            params,
            zero3_gathered_params(model, layout, params, stage),
            layout.zero_stage,
            shard_group,
            param_bytes=fsdp_param_bytes(layout),
            offload=layout.offload_optimizer,
        )
    return model_state_bytes(
        params,
        largest_layer_params(model, layout.dims.tp),
        layout.zero_stage,
        shard_group,
        layout.dtype,
        offload_optimizer=layout.offload_optimizer,
        offload_parameters=layout.offload_parameters,
    )


def busiest_rank_states(model: ModelSpec, layout: Layout) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes on the rank that holds the most
    parameters."""
    params = params_per_rank(
        model, layout.dims.tp, layout.dims.pp, layout.rank_layers(model.layers), layout.dims.ep
    )
    return state_bytes(model, layout, params, experts=stage_expert_params(model, layout))


def stage_states(model: ModelSpec, layout: Layout, stage: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes on PP rank `stage`."""
    return state_bytes(
        model,
        layout,
        stage_params(model, layout, stage),
        stage,
        stage_expert_params(model, layout, stage),
    )


# --------------------------------------------------------------------------------------------
# gradient synchronisation and the engines' buffers
# --------------------------------------------------------------------------------------------
def pipeline_defers_gradient_sync(layout: Layout) -> bool:
    """FSDP2 under PP at ZeRO-1: torch's pipelining runs every micro-batch's backward without
    FSDP2's gradient sync or resharding (stage.py, backward_maybe_with_nosync) and
    reduce-scatters once after the last (perform_reduce_grad). At ZeRO-2/3 the trainer's
    stages reduce-scatter every micro-batch (pipeline.trainer_stage)."""
    return layout.fsdp_sharded and layout.dims.pp > 1 and layout.zero_stage < 2


def pipeline_accumulated_grad_bytes(layout: Layout, params: int) -> float:
    """What `pipeline_defers_gradient_sync` accumulates: the stage's `params`' unsharded
    gradients in fp32, the reduce dtype (FSDPParam.to_accumulated_grad_if_needed), from the
    first backward to the step."""
    return 4.0 * params if pipeline_defers_gradient_sync(layout) else 0.0


def fsdp_gather_buffer_bytes(model: ModelSpec, layout: Layout) -> float:
    """The flat output of FSDP2's last all-gather in forward, the last block's weights in the
    gathered dtype, which FSDP2 holds (FSDPCommContext.all_gather_state, so that no stream
    reuses it early) until the root module's forward ends; measured on the CPU, where it is
    live at the loss (tests/unit/test_memory_peak.py)."""
    if not layout.fsdp_sharded:
        return 0.0
    return fsdp_param_bytes(layout) * block_params(model, layout)


def fsdp_block_backward_bytes(model: ModelSpec, layout: Layout) -> float:
    """FSDP2's transients at the end of one block's backward: the block's unsharded gradients
    in the gathered parameters' dtype, and the flat reduce-scatter input in fp32 (the reduce
    dtype) they are copied into (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    foreach_reduce); under ZeRO-3 also the next block's gathered parameters (prefetched)."""
    if not layout.fsdp_sharded:
        return 0.0
    block = block_params(model, layout)
    prefetch = fsdp_param_bytes(layout) * block if layout.zero_stage == 3 else 0.0
    return (fsdp_param_bytes(layout) + 4) * block + prefetch


def deepspeed_bucket_bytes(layout: Layout) -> int:
    """The bundled trainer under DeepSpeed ZeRO in bf16: backward reduces gradients through
    one contiguous bucket of reduce_bucket_size elements in the compute dtype (ipg_buffer in
    deepspeed/runtime/zero/stage_1_and_2.py; one, since the trainer sets overlap_comm false;
    ZeRO-3's flat bucket in stage3.py likewise), allocated at the first gradient hook of every
    micro-batch and dropped before the step. Measured: 400,000,000 bytes at 200 M elements
    (tests/unit/test_memory_peak.py), at ZeRO-3 with and without offload too."""
    if (
        layout.framework != "ctxlaunch"
        or layout.fsdp
        or layout.zero_stage not in (1, 2, 3)
        or layout.dims.shard_group == 1
        or layout.dtype != "bf16"
    ):
        return 0
    return ZERO_BUCKET_ELEMENTS * layout.compute_bytes


def communication_buffer_bytes(layout: Layout) -> int:
    """The gradient all-reduce buckets (ZeRO-0) or DeepSpeed's reduce and gather buckets."""
    if layout.dims.shard_group == 1 or layout.fsdp:
        # FSDP2's collectives gather into the parameters (model states) and reduce-scatter
        # from per-block buffers the phases hold (`fsdp_block_backward_bytes`).
        return 0
    if layout.zero_stage == 0:
        return 4 * GRAD_BUCKET_ELEMENTS
    if deepspeed_bucket_bytes(layout):
        return deepspeed_bucket_bytes(layout)  # in the phases too: counted once (`estimate`)
    if layout.zero_stage in (1, 2):
        return 2 * ZERO_BUCKET_ELEMENTS * layout.compute_bytes
    return 2 * ZERO3_PREFETCH_ELEMENTS * layout.compute_bytes
