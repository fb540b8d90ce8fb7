"""The per-GPU memory model: will this job fit, and with which CP degree.

Pure arithmetic over the slice of the spec it reads (`Layout`); no torch. The activation
constants are derived from the block the trainer builds (ctxlaunch/trainer/model.py) and checked
against memory measured with saved-tensor hooks (tests/test_memory_measured.py and
benchmarks/activation_memory.py).

Per rank, for one micro-batch of b sequences of s tokens, CP degree N, TP degree t:
  tokens held  n = b * s / N            (sequence split by CP)
  per-token activations are further divided by t (TP with Megatron-style sequence
  parallelism shards the per-token tensors that TP would otherwise replicate; the norm outputs
  the column-parallel projections read are kept as local shards and gathered again in
  backward, as in Megatron), except what is gathered over TP outside the blocks: the gradient
  of the loss input, the RoPE tables and the token ids.
Pipeline stages (`stage_activation_bytes`): the first holds the embedding's saved ids, the last
the final norm and the loss input; under 1F1B stage r keeps pp - r micro-batches in flight (at
most grad_accum) and the planner takes the busiest stage. Interleaved schedules are planned as
1F1B over each rank's blocks (an approximation). Measured: tests/test_memory_measured.py at
TP 2 and on both stages of PP 2.

Bytes saved for backward per token by one transformer block, with a = bytes of the compute
dtype and r = bytes of the residual stream (both 2 in bf16 under DeepSpeed; r = 4 under ZeRO-0
bf16, where torch autocast keeps fp32 weights and residual; both 4 in fp32):

    tensor (who saves it)                         bytes/token
    block input x (RMSNorm 1)                     r*h
    RMSNorm 1 output (fused q/k/v projection)     a*h
    q, k, v after RoPE (attention)                a*(h + 2*h_kv)
    attention output (attention)                  a*h
    log-sum-exp, fp32 (attention)                 4*heads
    attention output, token-major (o projection)  a*h
    x + attention (RMSNorm 2)                     r*h
    RMSNorm 2 output (fused gate/up projection)   a*h
    gate and up (SwiGLU)                          2*a*f
    SwiGLU output (down projection)               a*f
    two RMSNorm reciprocal RMS values, fp32       8

    total: 2*r*h + a*(5*h + 2*h_kv + 3*f) + 4*heads + 8

No s-by-s term: attention runs through flash kernels that keep only the log-sum-exp. For
Llama-3-8B in bf16 (h 4096, h_kv 1024, f 14336, 32 heads) that is 147,592 bytes = 36.0*h per
token, next to Korthikanti et al.'s 34*h for a GPT block with a 4h GELU MLP.

Under ZeRO-0 bf16 (autocast) each block also keeps the bf16 copies of its matmul weights for
backward: 2 bytes per weight, per block not recomputed.

Activation checkpointing:
- selective: the feed-forward half (RMSNorm 2 + SwiGLU, cheap and linear in s) is recomputed;
  attention (quadratic to recompute) is kept. Saved per block: r*h + a*(4*h + 2*h_kv) + 4*heads
  + 4, plus the feed-forward input r*h.
- full: only each block's input r*h is kept; one block is recomputed at a time in backward.

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
  does without PP (runtime/trainer/pipeline.py, trainer_stage), so only the fp32 shards
  accumulate (4/Nd), and ZeRO-3 re-shards the weights after each backward.

The peak, phase by phase (`peak_phases`, issue 18): what is live at the highest moment of each
phase of a steady-state step (step 2 on: AdamW creates its states at the first step()), by part:
- forward end: model states and everything saved;
- the loss, forward and backward per chunk (runtime/trainer/loss.py): the loss input and the
  gradient of it (r*h per token each), the head's gradient, one chunk's logits and, in 16-bit,
  their fp32 upcast (no fp32 copy of all the logits; no recomputation in backward);
- the last block's feed-forward backward, the step's peak at long context: the loss's saved
  tensors released (final norm input, the gradient of the gathered loss input), the SwiGLU output
  replaced by its gradient, gate's and up's gradients (2*a*f per token), the chunked SwiGLU
  backward's fp32 temporaries (2 (chunk x f) in fp32, 4 in 16-bit), the gradient flowing into
  the block (r*h), under checkpointing the recomputed half (and its bf16 weight copies), and
  the gradients produced so far (head, final norm, down projection);
- the optimizer step: every gradient, and foreach AdamW's fp32 denominator per parameter.
Under PP each stage is planned on its own (`peak_phases(..., stage=r)`; the step's peak is the
highest stage's), after torch.distributed.pipelining's Schedule1F1B as the trainer runs it:
stage r holds its own parameters, runs min(pp - r, micro-batches) forwards before its first
backward, keeps each forward's output (stages before the last) for the backward, and keeps one
receive buffer per micro-batch of the step for activations (stages after the first) and for
gradients (stages before the last); the last stage keeps every micro-batch's output until the
step ends (return_outputs), and a stage after the first the previous backward's input gradient.
Backward j of the step runs with min(j + in-flight, micro-batches) - j micro-batches saved and,
from the second on, with every gradient of the stage.
Before the chunked backward passes (model.py), SwiGLU's backward held 7 fp32 (tokens x f)
temporaries in bf16 (28 bytes per token per f; 32 with its outputs), which no term counted.
Measured against the allocator's own record (memtrace.AllocatorTrace) on the CPU in
tests/test_memory_peak.py. `estimate` never plans below the peak.

What the model does not know precisely is an allowance, stated: on a GPU 1.5 GiB (CUDA context,
cuBLAS workspaces, NCCL channels) plus 5 % of everything else for allocator fragmentation, plus
`cuda_kernel_allowance` (FlashAttention's fp32 dQ accumulator and the caching allocator's
segments); on the CPU 0.4 GiB (the Python and torch runtime) plus 5 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxlaunch.contract.hardware import GiB, GpuInfo
from ctxlaunch.perf.flops import count_params
from ctxlaunch.perf.layout import Layout, default_rank_layers

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec

# Constants the trainer uses too, so the planner and the run agree.
LOSS_CHUNK_TOKENS = 2048
"""The output head and cross-entropy run over chunks of this many tokens, each recomputed in
backward, so the (tokens x vocab) logits never exist for the whole local sequence at once."""
BACKWARD_CHUNK_TOKENS = 1024
"""The RMSNorm and SwiGLU backward passes compute their fp32 pointwise math over chunks of this
many tokens, so those temporaries do not grow with the sequence."""
GRAD_BUCKET_ELEMENTS = 25_000_000
"""ZeRO-0: gradients are all-reduced over DP x CP in flat buckets of this many elements."""
ZERO_BUCKET_ELEMENTS = 200_000_000
"""ZeRO-1/2: DeepSpeed reduce_bucket_size and allgather_bucket_size."""
ZERO3_PREFETCH_ELEMENTS = 50_000_000
"""ZeRO-3: DeepSpeed stage3_prefetch_bucket_size."""

GPU_FIXED_ALLOWANCE = int(1.5 * GiB)
CPU_FIXED_ALLOWANCE = int(0.4 * GiB)
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of one rank, by part, in bytes."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    """Saved for backward at the peak (the start of backward)."""
    workspace: int
    """The largest transient on top: the chunked loss, or one block's attention buffers and
    recomputation in backward."""
    communication_buffers: int
    """Gradient all-reduce / ZeRO buckets."""
    allowance: int
    capacity: int

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.workspace
            + self.communication_buffers
            + self.allowance
        )

    @property
    def headroom(self) -> int:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def parts(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_states", self.optimizer_states),
            ("activations", self.activations),
            ("workspace", self.workspace),
            ("communication_buffers", self.communication_buffers),
            ("allowance", self.allowance),
        ]

    def to_dict(self) -> dict[str, int | bool]:
        out: dict[str, int | bool] = {f"{name}_bytes": value for name, value in self.parts()}
        out.update(
            total_bytes=self.total,
            capacity_bytes=self.capacity,
            headroom_bytes=self.headroom,
            fits=self.fits,
        )
        return out


# --------------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------------
def block_activation_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Bytes one transformer block saves for backward per token, for the layout's
    checkpointing mode (the table in the module docstring)."""
    a, r = layout.compute_bytes, layout.residual_bytes
    h, f = model.hidden, model.ffn_hidden
    h_kv = model.kv_hidden
    attention_half = r * h + a * (4 * h + 2 * h_kv) + 4 * model.heads + 4
    feed_forward_half = r * h + a * (h + 3 * f) + 4
    # TP with sequence parallelism divides every per-token tensor by t, the norm outputs the
    # column-parallel projections read included: as in Megatron, each projection keeps its
    # input's local shard and gathers it again in backward (tensor_parallel.gather_linear).
    mode = layout.activation_checkpointing
    if mode == "none":
        return attention_half + feed_forward_half
    if mode == "selective":
        return attention_half + r * h
    return r * h


def _recompute_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """What recomputing one block in backward adds back while it is being differentiated."""
    mode = layout.activation_checkpointing
    if mode == "none":
        return 0.0
    full = block_activation_bytes_per_token(model, layout.replace(activation_checkpointing="none"))
    if mode == "full":
        return full
    selective = block_activation_bytes_per_token(model, layout)
    return full - selective


def _attention_workspace_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Transient buffers of one attention call in backward (its peak), per local token:
    fp32 dQ accumulator, K/V grads and their transfer buffers, kernel outputs."""
    a = layout.compute_bytes
    h, h_kv = model.hidden, model.kv_hidden
    kernel_grads = a * 3 * h  # dq, dk, dv from the kernel, K/V expanded to all query heads
    if layout.cp == 1:
        return kernel_grads
    if layout.cp_algorithm == "ulysses":
        # all-to-all in and out buffers for q, k, v (and their grads): same size per rank.
        return 2 * a * (h + 2 * h_kv) + kernel_grads
    if layout.cp_algorithm == "allgather":
        # fp32 dQ; the whole sequence's K/V gathered (cp x the local tokens) and their fp32
        # dK/dV before the reduce-scatter.
        return 4 * h + layout.cp * (2 * a * h_kv + 2 * 4 * h_kv) + kernel_grads
    # ring (and the ring part of hybrid): fp32 dQ, fp32 dK/dV in hand and in flight, K/V in
    # hand and in flight.
    return 4 * h + 2 * 2 * 4 * h_kv + 2 * 2 * a * h_kv + kernel_grads


def _loss_workspace_bytes(model: ModelSpec, layout: Layout) -> float:
    """The chunked loss's transients (runtime/trainer/loss.py: each chunk's backward done in its
    forward): one chunk's logits in the compute dtype, in 16-bit their one fp32 upcast (the
    softmax and then the logits' gradient, formed in place and cast back into the logits'
    buffer; in fp32 the logits themselves are that work), and under autocast the head weight's
    compute-dtype copy (made once for every chunk) and the chunk of the loss input cast to
    it. The per-token statistics (about 50 bytes per token of the chunk) are left out. The
    largest of what follows the softmax (the input gradient's chunk before it is written into
    the fp32 whole, the head gradient's per-chunk product before it is added to the fp32
    accumulator) is smaller than the upcast at any vocabulary above the hidden size."""
    tokens = min(layout.tokens_per_rank, LOSS_CHUNK_TOKENS)
    vocab = model.vocab / layout.tp
    a, h = layout.compute_bytes, model.hidden
    if layout.framework != "ctxlaunch":
        # Other frameworks' habits keep the earlier model of a recomputed chunk: logits, their
        # fp32 copy, the fp32 log-softmax and the fp32 logits gradient.
        return (a + 12) * vocab * tokens
    upcast = 4 * vocab * tokens if a != 4 else 0.0
    copies = a * (vocab + tokens) * h if layout.residual_bytes != a else 0.0
    return a * vocab * tokens + upcast + copies


def autocast_weight_copy_bytes(model: ModelSpec, layout: Layout) -> float:
    """ZeRO-0 bf16 runs under autocast: each block's matmuls save the bf16 copies of their fp32
    weights for backward (2 bytes per weight), except where the block is recomputed."""
    if layout.dtype != "bf16" or not layout.fp32_weights:
        return 0.0
    h, h_kv, f = model.hidden, model.kv_hidden, model.ffn_hidden
    attention = h * (h + 2 * h_kv) + h * h
    feed_forward = 3 * h * f
    kept = {"none": attention + feed_forward, "selective": attention, "full": 0}
    return 2.0 * kept[layout.activation_checkpointing] / layout.tp


def activation_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes saved for backward on the busiest rank (the busiest pipeline stage) at the start
    of backward."""
    if layout.pp == 1:
        return stage_activation_bytes(model, layout, model.layers, first=True, last=True)
    # 1F1B: stage r holds the activations of up to pp - r micro-batches in flight.
    return max(
        min(layout.pp - r, layout.grad_accum)
        * stage_activation_bytes(model, layout, held, first=r == 0, last=r == layout.pp - 1)
        for r, held in enumerate(layout.rank_layers(model.layers))
    )


def stage_activation_bytes(
    model: ModelSpec, layout: Layout, blocks: int, *, first: bool, last: bool
) -> float:
    """Bytes one micro-batch leaves saved for backward on a pipeline stage of `blocks` blocks
    (with the embedding if `first`, the final norm and the loss if `last`)."""
    t = layout.tp
    tokens = layout.tokens_per_rank / t  # per rank, sequence-parallel under TP
    r = layout.residual_bytes
    # Outside the blocks, per sequence-parallel token: the RoPE cos/sin tables (one pair for
    # every block, over the CP shard's tokens); on the first stage the int64 token ids (and,
    # under TP, the vocabulary mask of the parallel embedding); on the last the final RMSNorm
    # input and rstd, and the gradient of the chunked loss's input (gathered over TP): the loss
    # computes it in forward and keeps it, in place of the input it no longer keeps.
    outside = 2 * model.head_dim * layout.compute_bytes * t
    if first:
        outside += 8 * t + (t if t > 1 else 0)
    if last:
        outside += r * model.hidden + 4 + r * model.hidden * t
        if layout.framework != "ctxlaunch":
            outside += 8 * t  # the int64 targets, which a recomputed loss keeps
    per_block = block_activation_bytes_per_token(model, layout)
    return (
        tokens * (per_block * blocks + outside) + autocast_weight_copy_bytes(model, layout) * blocks
    )


# --------------------------------------------------------------------------------------------
# the peak, phase by phase
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """What one rank holds at the highest moment of one phase of a steady-state step (step 2 on:
    the Adam states exist from the first `step()`), in bytes by part."""

    name: str
    parameters: float
    gradients: float
    """Gradients that exist at that moment (set_to_none: only those produced so far)."""
    optimizer_states: float
    activations: float
    """Saved for backward and not yet released, recomputed parts included."""
    workspace: float
    """Transients: gradients in flight between ops, kernel temporaries, the loss chunk, the
    step's integer inputs (`input_bytes`), and the pipeline schedule's receive buffers."""
    stage: int = 0
    """The pipeline stage (PP rank) this is the phase of."""

    @property
    def total(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.workspace
        )

    def parts(self) -> list[tuple[str, float]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_states", self.optimizer_states),
            ("activations", self.activations),
            ("workspace", self.workspace),
        ]

    def to_dict(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {"name": self.name, "stage": self.stage}
        out.update({f"{name}_bytes": int(value) for name, value in self.parts()})
        out["total_bytes"] = int(self.total)
        return out


def _states(model: ModelSpec, layout: Layout) -> tuple[float, float, float]:
    params = params_per_rank(model, layout.tp, layout.pp, layout.rank_layers(model.layers))
    return state_bytes(model, layout, params)


def state_bytes(
    model: ModelSpec, layout: Layout, params: int, stage: int | None = None
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) bytes of `params` parameters on one rank (PP
    rank `stage`, or any), by the engine the layout runs (FSDP2, DeepSpeed or plain torch)."""
    if layout.fsdp:
        return fsdp_state_bytes(
            params,
            zero3_gathered_params(model, layout, params, stage),
            layout.zero_stage,
            layout.shard_group,
            param_bytes=_fsdp_param_bytes(layout),
        )
    return model_state_bytes(
        params,
        largest_layer_params(model, layout.tp),
        layout.zero_stage,
        layout.shard_group,
        layout.dtype,
    )


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
    last = stage is None or stage == layout.pp - 1
    root = (counts.embedding if first else 0) + (counts.final_norm + counts.head if last else 0)
    return min(params, -(-(2 * counts.per_layer + root) // layout.tp))


def _fsdp_param_bytes(layout: Layout) -> int:
    """Bytes per element of FSDP2's gathered (unsharded) parameters and of the gradients
    autograd produces into them before the reduce-scatter."""
    return 2 if layout.fsdp_bf16_params else 4


def _block_params(model: ModelSpec, layout: Layout) -> float:
    """One block's parameters on a rank (its TP slice): what FSDP2 gathers and reduces as a
    unit."""
    return count_params(model).per_layer / layout.tp


def pipeline_defers_gradient_sync(layout: Layout) -> bool:
    """FSDP2 under PP at ZeRO-1: torch's pipelining runs every micro-batch's backward without
    FSDP2's gradient sync or resharding (stage.py, backward_maybe_with_nosync) and
    reduce-scatters once after the last (perform_reduce_grad). At ZeRO-2/3 the trainer's
    stages reduce-scatter every micro-batch (pipeline.trainer_stage)."""
    return layout.fsdp_sharded and layout.pp > 1 and layout.zero_stage < 2


def pipeline_accumulated_grad_bytes(layout: Layout, params: int) -> float:
    """What `pipeline_defers_gradient_sync` accumulates: the stage's `params`' unsharded
    gradients in fp32, the reduce dtype (FSDPParam.to_accumulated_grad_if_needed), from the
    first backward to the step."""
    return 4.0 * params if pipeline_defers_gradient_sync(layout) else 0.0


def fsdp_gather_buffer_bytes(model: ModelSpec, layout: Layout) -> float:
    """The flat output of FSDP2's last all-gather in forward, the last block's weights in the
    gathered dtype, which FSDP2 holds (FSDPCommContext.all_gather_state, so that no stream
    reuses it early) until the root module's forward ends; measured on the CPU, where it is
    live at the loss (tests/test_memory_peak.py)."""
    if not layout.fsdp_sharded:
        return 0.0
    return _fsdp_param_bytes(layout) * _block_params(model, layout)


def fsdp_block_backward_bytes(model: ModelSpec, layout: Layout) -> float:
    """FSDP2's transients at the end of one block's backward: the block's unsharded gradients
    in the gathered parameters' dtype, and the flat reduce-scatter input in fp32 (the reduce
    dtype) they are copied into (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    foreach_reduce); under ZeRO-3 also the next block's gathered parameters (prefetched)."""
    if not layout.fsdp_sharded:
        return 0.0
    block = _block_params(model, layout)
    prefetch = _fsdp_param_bytes(layout) * block if layout.zero_stage == 3 else 0.0
    return (_fsdp_param_bytes(layout) + 4) * block + prefetch


def _loss_released_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """What the last stage saved outside the blocks for the loss (final norm input and rstd,
    the gradient of the gathered loss input), released once the final norm's backward is
    done; per sequence-parallel token."""
    t, r = layout.tp, layout.residual_bytes
    return r * model.hidden + 4 + r * model.hidden * t


def _feed_forward_recompute_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Under checkpointing, what recomputing the last block's feed-forward half saves again
    (norm output, gate and up, SwiGLU output, rstd); per sequence-parallel token."""
    if layout.activation_checkpointing == "none":
        return 0.0
    a = layout.compute_bytes
    return a * (model.hidden + 3 * model.ffn_hidden) + 4


def _attention_recompute_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Under full checkpointing, the attention half recomputed (all but the block input)."""
    if layout.activation_checkpointing != "full":
        return 0.0
    a = layout.compute_bytes
    h, h_kv = model.hidden, model.kv_hidden
    return layout.residual_bytes * h + a * (4 * h + 2 * h_kv) + 4 * model.heads + 4


def _swiglu_backward_temporaries(model: ModelSpec, layout: Layout) -> float:
    """The chunked SwiGLU backward's fp32 temporaries: two (chunk x ffn) tensors in fp32, four
    in 16-bit (with the upcasts of gate and the incoming gradient)."""
    tokens = min(layout.tokens_per_rank, BACKWARD_CHUNK_TOKENS)
    count = 2 if layout.compute_bytes == 4 else 4
    return count * 4 * tokens * model.ffn_hidden / layout.tp


def _head_grad_bytes(model: ModelSpec, layout: Layout, params_bytes_per_param: float) -> float:
    """The output head's (or tied embedding's) gradient, which the chunked loss accumulates
    from its first chunk on."""
    counts = count_params(model)
    return params_bytes_per_param * (counts.head or counts.embedding) / layout.tp


def _last_block_grad_bytes(
    model: ModelSpec, layout: Layout, params_bytes_per_param: float
) -> float:
    """Gradients produced by the time the last block's feed-forward is differentiated: the
    output head (or tied embedding), the final norm gain, the down projection."""
    counts = count_params(model)
    head = counts.head if counts.head else counts.embedding
    return (
        params_bytes_per_param * (head + model.hidden + model.hidden * model.ffn_hidden) / layout.tp
    )


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Parameters PP rank `stage` holds before ZeRO sharding (its blocks, the embedding on the
    first, the final norm and head on the last), split by TP."""
    if layout.pp == 1:
        return params_per_rank(model, layout.tp, 1)
    counts = count_params(model)
    held = counts.per_layer * layout.rank_layers(model.layers)[stage]
    if stage == 0:
        held += counts.embedding
    if stage == layout.pp - 1:
        held += counts.final_norm + counts.head
    return -(-held // layout.tp)


def _stage_states(model: ModelSpec, layout: Layout, stage: int) -> tuple[float, float, float]:
    return state_bytes(model, layout, stage_params(model, layout, stage), stage)


INPUT_BYTES_PER_TOKEN = 3 * 8
"""A micro-batch's integer inputs on the device (runtime/trainer/batches.py, MicroBatch): token
ids, targets and RoPE positions, int64 each, of the rank's CP shard (all TP ranks hold them)."""


def input_bytes(layout: Layout) -> float:
    """The step's inputs held on a rank: one micro-batch's (the engine moves each to the device
    as it runs it; the embedding keeps its token ids for backward), or under PP every
    micro-batch's (the schedule takes the whole step's tokens and targets at once)."""
    micro_batches = layout.grad_accum if layout.pp > 1 else 1
    return INPUT_BYTES_PER_TOKEN * layout.tokens_per_rank * micro_batches


def pipeline_recv_buffers(n_stages: int, stage: int, n_micro: int) -> tuple[int, int]:
    """Under 1F1B (one stage a rank) the trainer's receive buffers on stage `stage` of
    `n_stages`, (activations, gradients), micro-batch i using buffer i mod that count
    (runtime/trainer/pipeline.py, `trainer_stage`): a stage runs min(n_micro, n_stages - stage)
    warm-up forwards and receives micro-batch i + that many only after i's backward, which is
    when i's input (its blocks' saved input) is released; a gradient is received right before
    its backward, which consumes it, and the next one after."""
    return min(n_micro, n_stages - stage), min(n_micro, 1)


def pipeline_buffer_bytes(model: ModelSpec, layout: Layout, stage: int) -> float:
    """The schedule's receive buffers on PP rank `stage` (torch.distributed.pipelining), each
    one micro-batch's (micro_batch, tokens / tp, h) hidden states, for the activations coming
    in (every stage but the first) and the gradients coming back (every stage but the last),
    allocated at the first step and kept; in the residual stream's dtype (fp32 under
    autocast's fp32 weights, bf16 under FSDP2's bf16 parameters). Under 1F1B as many as
    `pipeline_recv_buffers`; under interleaved 1F1B torch's own, one per micro-batch."""
    if layout.pp == 1:
        return 0.0
    one = layout.residual_bytes * model.hidden * layout.tokens_per_rank / layout.tp
    if layout.virtual_stages > 1:
        activations = gradients = layout.grad_accum
    else:
        activations, gradients = pipeline_recv_buffers(layout.pp, stage, layout.grad_accum)
    return one * (activations * (stage > 0) + gradients * (stage < layout.pp - 1))


def peak_phases(model: ModelSpec, layout: Layout, stage: int | None = None) -> list[Phase]:
    """The highest moment of each phase of a steady-state step on PP rank `stage` (default:
    the rank whose peak is highest): the end of forward, the loss chunk in backward (last
    stage), the feed-forward backward of the stage's last block (SwiGLU), and the optimizer
    step. The peak of the step is the largest (`peak`)."""
    if stage is not None or layout.pp == 1:
        return _stage_phases(model, layout, stage or 0)
    per_stage = [_stage_phases(model, layout, r) for r in range(layout.pp)]
    return max(per_stage, key=lambda phases: max(p.total for p in phases))


def _stage_phases(model: ModelSpec, layout: Layout, stage: int) -> list[Phase]:
    pp = layout.pp
    first, last = stage == 0, stage == pp - 1
    blocks = layout.rank_layers(model.layers)[stage] if pp > 1 else model.layers
    parameters, gradients, optimizer = _stage_states(model, layout, stage)
    a, r, h = layout.compute_bytes, layout.residual_bytes, model.hidden
    tokens = layout.tokens_per_rank / layout.tp  # sequence-parallel tokens
    full_tokens = layout.tokens_per_rank  # tokens of the CP shard (TP-gathered)
    grad_per_param = gradients / max(stage_params(model, layout, stage), 1)
    # 1F1B: stage r runs pp - r forwards before its first backward (at most the step's
    # micro-batches), each leaving what it saved, and on a stage that sends its output on,
    # that output, which the schedule keeps for the stage's backward. On every stage but the
    # first the blocks' input is the schedule's receive buffer (`pipeline_buffer_bytes`),
    # not a tensor of its own.
    in_flight = min(pp - stage, layout.grad_accum) if pp > 1 else 1
    one = stage_activation_bytes(model, layout, blocks, first=first, last=last)
    if pp > 1:
        one += r * h * tokens * ((not last) - (not first))
    buffers = pipeline_buffer_bytes(model, layout, stage) + input_bytes(layout)
    # FSDP2 under PP at ZeRO-1: from the first backward on the stage's unsharded gradients
    # accumulate (`pipeline_accumulated_grad_bytes`); at ZeRO-2/3 each block's are
    # reduce-scattered at the end of its backward, as without PP (`sharded_sync`).
    fsdp = layout.fsdp_sharded
    held_params = stage_params(model, layout, stage)
    accumulated_unsharded = pipeline_accumulated_grad_bytes(layout, held_params)
    sharded_sync = fsdp and not pipeline_defers_gradient_sync(layout)
    # DeepSpeed ZeRO-1/2 (bf16): the fp32 gradient partition exists only inside the optimizer
    # step, and backward fills one reduce bucket (`deepspeed_bucket_bytes`).
    bucket = deepspeed_bucket_bytes(layout)
    held_states = optimizer - (
        4 * stage_params(model, layout, stage) // layout.shard_group if bucket else 0
    )
    saved = in_flight * one
    phases = [Phase("forward", parameters, 0.0, held_states, saved, buffers, stage)]
    buffers += bucket  # from the first backward hook to the end of backward
    n = layout.grad_accum
    between = r * h * tokens  # one micro-batch's hidden states between stages
    if last:
        # The loss, forward and backward chunk by chunk: the gradient of its whole input (in
        # `saved`) and the head weight's exist from the first chunk on, next to the input
        # itself and one chunk's logits and their fp32 work. From the second micro-batch on,
        # next to every gradient the earlier ones left (FSDP2: the sharded ones, or under PP
        # the accumulating unsharded ones), the head's new gradient not yet added in (FSDP2:
        # unsharded, in the gathered weights' dtype).
        loss_input = r * h * full_tokens
        head_grad = _head_grad_bytes(
            model, layout, _fsdp_param_bytes(layout) if fsdp else grad_per_param
        )
        work = buffers + loss_input + _loss_workspace_bytes(model, layout)
        if pp == 1:
            # The trainer's loss runs inside the root module's forward, where FSDP2 still
            # holds its last all-gather's flat output (`fsdp_gather_buffer_bytes`).
            work += fsdp_gather_buffer_bytes(model, layout)
        phases.append(Phase("loss", parameters, head_grad, held_states, saved, work, stage))
        if n > 1:
            kept = between * (1 + (not first)) if pp > 1 else 0.0
            phases.append(
                Phase(
                    f"loss (micro-batch 2 of {n})",
                    parameters,
                    head_grad + (accumulated_unsharded or gradients),
                    held_states,
                    saved,
                    work + kept,
                    stage,
                )
            )
    # The last block's feed-forward backward: the loss's saved tensors released (last stage),
    # the SwiGLU output replaced by its gradient (same bytes), gate and up's gradients and the
    # chunk's fp32 temporaries on top, with the gradient flowing into the block (on a stage
    # that is not the last it arrived in a receive buffer). Backward j of the step (1F1B) runs
    # with min(j + in_flight, n) - j micro-batches still saved, the current one included, and
    # from the second on with every gradient of the stage (accumulated). On the last stage the
    # schedule keeps every micro-batch's output until the step ends (torch's
    # return_outputs=True, which the trainer does not turn off), and on every stage but the
    # first the previous backward's input gradient stays referenced (the stage's grads_input)
    # until the next one replaces it.
    f = model.ffn_hidden / layout.tp
    recompute = tokens * (
        _feed_forward_recompute_bytes_per_token(model, layout)
        + _attention_recompute_bytes_per_token(model, layout)
    )
    if layout.activation_checkpointing != "none" and layout.fp32_weights and layout.dtype == "bf16":
        recompute += 2.0 * 3 * h * model.ffn_hidden / layout.tp  # bf16 weight copies again
    # Under FSDP2 the gradients of the block being differentiated, and of the root's weights
    # (head, final norm), are produced unsharded, in the gathered weights' dtype, and only
    # reduce-scattered into their fp32 shards after the block's (the root's) backward.
    produced_per_param = _fsdp_param_bytes(layout) if fsdp else grad_per_param
    if last:
        released = tokens * _loss_released_bytes_per_token(model, layout)
        produced = _last_block_grad_bytes(model, layout, produced_per_param)
    else:
        released = 0.0
        produced = produced_per_param * h * model.ffn_hidden / layout.tp  # the down projection
    root_unsharded = _head_grad_bytes(model, layout, produced_per_param) if fsdp and last else 0.0
    ffn_work = (
        (r * h * tokens if last else 0.0)
        + 2 * a * f * full_tokens
        + _swiglu_backward_temporaries(model, layout)
    )
    # Later backwards only hold fewer micro-batches, except the last stage's kept outputs, and
    # on a stage that warms up with two forwards or more (in_flight >= 2) the output of its
    # last-but-one warm-up forward: Schedule1F1B keeps that forward's send work (which holds
    # the sent tensor) in `send_work` until the step returns, so from that micro-batch's own
    # backward on (j >= in_flight - 1) one more output is held.
    retained_from = in_flight - 1 if pp > 1 and not last and in_flight >= 2 else n
    backwards = (
        {0, min(1, n - 1)}
        | ({n - 1} if pp > 1 and last else set())
        | ({retained_from} if retained_from < n else set())
    )
    for j in sorted(backwards):
        held = (min(j + in_flight, n) - j) * one + recompute - released
        extra = 0.0
        if pp > 1 and last:
            extra += (j + 1) * between
        if pp > 1 and not first and j > 0:
            extra += between
        if j >= retained_from:
            extra += between
        name = "block backward" if j == 0 else f"block backward (micro-batch {j + 1} of {n})"
        accumulated = (accumulated_unsharded or gradients) if j > 0 else 0.0
        phases.append(
            Phase(
                name,
                parameters,
                produced + accumulated if fsdp else (produced if j == 0 else gradients),
                held_states,
                held,
                buffers + ffn_work + extra,
                stage,
            )
        )
        if sharded_sync:
            # The end of that block's backward: what the micro-batch saved in it released, its
            # unsharded gradients and the fp32 reduce-scatter input.
            phases.append(
                Phase(
                    f"{name}, FSDP2 reduce-scatter",
                    parameters,
                    root_unsharded + accumulated,
                    held_states,
                    held - tokens * block_activation_bytes_per_token(model, layout),
                    buffers + extra + r * h * tokens + fsdp_block_backward_bytes(model, layout),
                    stage,
                )
            )
    if accumulated_unsharded:
        # After the last backward: each block's accumulated gradients copied into an fp32
        # reduce-scatter input, the previous block's still held (one retained by default).
        phases.append(
            Phase(
                "FSDP2 reduce-scatter after the last backward",
                parameters,
                accumulated_unsharded + gradients,
                held_states,
                0.0,
                buffers + 2 * 4 * _block_params(model, layout),
                stage,
            )
        )
    # The optimizer step: every gradient, and foreach AdamW's fp32 denominator for every
    # parameter (sqrt of the second moment, divided, plus eps) before the update.
    phases.append(
        Phase(
            "optimizer step",
            parameters,
            gradients,
            optimizer,
            0.0,
            buffers - bucket + parameters,
            stage,
        )
    )
    return phases


def peak(model: ModelSpec, layout: Layout, stage: int | None = None) -> Phase:
    """The highest phase of a steady-state step on PP rank `stage` (default: the busiest;
    see `peak_phases`)."""
    return max(peak_phases(model, layout, stage), key=lambda p: p.total)


# --------------------------------------------------------------------------------------------
# model states
# --------------------------------------------------------------------------------------------
def params_per_rank(
    model: ModelSpec, tp: int, pp: int, rank_layers: list[int] | None = None
) -> int:
    """Parameters held by the busiest rank before ZeRO sharding: a pipeline stage's blocks
    (plus the embedding or the head on the end stages) split by TP. `rank_layers`: blocks per
    PP rank (default: the balanced split the validator gives a spec, `default_rank_layers`)."""
    counts = count_params(model)
    if pp == 1:
        return -(-counts.total // tp)
    layers = rank_layers or default_rank_layers(model.layers, pp)
    held = [counts.per_layer * n for n in layers]
    held[0] += counts.embedding
    held[-1] += counts.final_norm + counts.head
    return -(-max(held) // tp)


def model_state_bytes(
    params: int, largest_layer_params: int, stage: int, shard_group: int, dtype: str
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) bytes per rank; see the module docstring."""
    n = shard_group
    if stage == 0:
        return 4 * params, 4 * params, 8 * params
    if dtype == "bf16":
        if stage == 1:
            return 2 * params, 2 * params, 16 * params // n
        if stage == 2:
            return 2 * params, 2 * params // n, 16 * params // n
        return 2 * params // n + 4 * largest_layer_params, 2 * params // n, 14 * params // n
    if stage == 1:
        return 4 * params, 4 * params, 12 * params // n
    if stage == 2:
        return 4 * params, 4 * params // n, 12 * params // n
    return 4 * params // n + 4 * largest_layer_params, 4 * params // n, 12 * params // n


def fsdp_state_bytes(
    params: int, zero3_gathered: int, stage: int, shard_group: int, *, param_bytes: int = 4
) -> tuple[int, int, int]:
    """FSDP2 over DP x CP (ZeRO >= 1 with TP or PP): fp32 master weights, fp32 gradients and
    Adam states sharded, 16/Nd per parameter; the gathered weights in `param_bytes` per element
    (2 under bf16: the mixed-precision policy gathers bf16 copies of the fp32 shards), every
    block's kept from forward to backward under ZeRO 1-2, under ZeRO-3 `zero3_gathered`
    (`zero3_gathered_params`: two blocks' and the root's)."""
    n = shard_group
    if n == 1:  # nothing to shard over: the trainer keeps plain fp32 states (ZeRO-0)
        return 4 * params, 4 * params, 8 * params
    gathered = param_bytes * (params if stage < 3 else zero3_gathered)
    return 4 * params // n + gathered, 4 * params // n, 8 * params // n


def largest_layer_params(model: ModelSpec, tp: int = 1) -> int:
    counts = count_params(model)
    return -(-max(counts.per_layer, counts.embedding, counts.head) // tp)


def deepspeed_bucket_bytes(layout: Layout) -> int:
    """The bundled trainer under DeepSpeed ZeRO-1/2 in bf16: backward reduces gradients through
    one contiguous bucket of reduce_bucket_size elements in the compute dtype (ipg_buffer in
    deepspeed/runtime/zero/stage_1_and_2.py; one, since the trainer sets overlap_comm false),
    allocated at the first gradient hook of every micro-batch and dropped before the step.
    Measured: 400,000,000 bytes at 200 M elements (tests/test_memory_peak.py)."""
    if (
        layout.framework != "ctxlaunch"
        or layout.fsdp
        or layout.zero_stage not in (1, 2)
        or layout.shard_group == 1
        or layout.dtype != "bf16"
    ):
        return 0
    return ZERO_BUCKET_ELEMENTS * layout.compute_bytes


def _communication_buffer_bytes(layout: Layout) -> int:
    if layout.shard_group == 1 or layout.fsdp:
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


# --------------------------------------------------------------------------------------------
# the estimate and the searches
# --------------------------------------------------------------------------------------------
def cuda_kernel_allowance(model: ModelSpec, layout: Layout) -> float:
    """What a CUDA GPU allocates that the CPU measurement (tests/test_memory_peak.py) does not
    show, per rank, beyond GPU_FIXED_ALLOWANCE (context, cuBLAS workspaces, NCCL) and
    FRAGMENTATION (see the module docstring): FlashAttention-2's backward keeps an fp32 dQ
    accumulator (B x S x H x D, `dq_accum` in flash_bwd_launch_template.h) and the fp32
    softmax-d buffer (B x H x S) next to dq, dk, dv, none of which the CPU flash kernel
    allocates at full size; the caching allocator rounds every block up to 512 B and carves
    small blocks (<= 1 MiB) out of 2 MiB segments and large ones out of 20 MiB segments
    (c10/cuda/CUDACachingAllocator.cpp, kRoundSmall/kSmallBuffer/kLargeBuffer): one 2 MiB
    small segment and one 20 MiB large segment half-empty at the peak are allowed for."""
    # Under Ulysses the kernel sees the whole sequence and heads / N: the same bytes.
    flash = layout.tokens_per_rank * (4 * model.hidden + 4 * model.heads) / layout.tp
    return flash + 2 * 2**20 + 20 * 2**20


def estimate(model: ModelSpec, layout: Layout, gpu: GpuInfo) -> MemoryEstimate:
    """Predicted peak memory of the busiest rank."""
    parameters, gradients, optimizer = _states(model, layout)
    gradients += pipeline_accumulated_grad_bytes(
        layout, params_per_rank(model, layout.tp, layout.pp, layout.rank_layers(model.layers))
    )
    activations = activation_bytes(model, layout)
    tokens = layout.tokens_per_rank / layout.tp
    workspace = max(
        _loss_workspace_bytes(model, layout),
        tokens
        * (
            _attention_workspace_bytes_per_token(model, layout)
            + _recompute_bytes_per_token(model, layout)
            # gradients flowing between blocks: d(out) and d(in) of the block
            + 2 * layout.residual_bytes * model.hidden
        ),
    )
    # The phase-by-phase peak (issue 18): never plan below what is live at the highest moment
    # of a steady-state step of the bundled trainer, whatever the sum of the parts above says.
    comm = _communication_buffer_bytes(layout)
    if layout.framework == "ctxlaunch":
        workspace = max(
            workspace,
            peak(model, layout).total
            - (parameters + gradients + optimizer + activations + deepspeed_bucket_bytes(layout)),
        )
    known = parameters + gradients + optimizer + activations + workspace + comm
    fixed = (
        CPU_FIXED_ALLOWANCE
        if gpu.name == "cpu"
        else GPU_FIXED_ALLOWANCE + cuda_kernel_allowance(model, layout)
    )
    return MemoryEstimate(
        parameters=int(parameters),
        gradients=int(gradients),
        optimizer_states=int(optimizer),
        activations=int(activations),
        workspace=int(workspace),
        communication_buffers=int(comm),
        allowance=int(fixed + FRAGMENTATION * known),
        capacity=gpu.memory_bytes,
    )


def sequence_granularity(cp: int, cp_sharding: str = "zigzag") -> int:
    """Sequence lengths the planner tries are multiples of this (legal for the CP layout)."""
    unit = 2 * cp if cp_sharding == "zigzag" else cp
    return max(unit, 1024) if 1024 % unit == 0 else unit


def longest_sequence(
    model: ModelSpec,
    layout: Layout,
    gpu: GpuInfo,
    cp_sharding: str = "zigzag",
    limit: int = 1 << 24,
) -> int:
    """The longest sequence (a multiple of `sequence_granularity`) that fits at the layout's
    CP degree; 0 when not even the shortest fits."""
    unit = sequence_granularity(layout.cp, cp_sharding)

    def fits(n_units: int) -> bool:
        return estimate(model, layout.replace(seq_len=n_units * unit), gpu).fits

    lo, hi = 0, limit // unit
    if fits(hi):
        return hi * unit
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * unit
