"""What a rank saves for backward, per token and per pipeline stage, and the transients of one
attention call and of the chunked loss. Part of the per-GPU memory model (ctxlaunch.perf.memory,
which adds them up); pure arithmetic over the layout, no torch. The constants are derived from
the block the trainer builds (ctxlaunch/runtime/modeling/model.py) and checked against memory
measured with saved-tensor hooks (tests/unit/test_memory_measured.py and
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
1F1B over each rank's blocks (an approximation). Measured: tests/unit/test_memory_measured.py at
TP 2 and on both stages of PP 2.

Bytes saved for backward per token by one transformer block, with a = bytes of the compute
dtype and r = bytes of the residual stream (both 2 in bf16 under DeepSpeed; r = 4 under ZeRO-0
bf16, where torch autocast keeps fp32 weights and residual; both 4 in fp32), h the hidden size,
h_q = heads x head_dim the query width (h itself unless the family sets head_dim apart from
hidden / heads), h_kv the K/V width and f the feed-forward width:

    tensor (who saves it)                         bytes/token
    block input x (RMSNorm 1)                     r*h
    RMSNorm 1 output (fused q/k/v projection)     a*h
    q, k, v after RoPE (attention)                a*(h_q + 2*h_kv)
    attention output (attention)                  a*h_q
    log-sum-exp, fp32 (attention)                 4*heads
    attention output, token-major (o projection)  a*h_q
    x + attention (RMSNorm 2)                     r*h
    RMSNorm 2 output (fused gate/up projection)   a*h
    gate and up (SwiGLU)                          2*a*f
    SwiGLU output (down projection)               a*f
    two RMSNorm reciprocal RMS values, fp32       8
  with q/k norms:
    the fused q/k/v output (q and k norms' input) a*(h_q + 2*h_kv)
    their reciprocal RMS values, fp32             4*(heads + kv_heads)
  with norms after each sub-block (post-norms):
    the o and down projections' outputs (inputs)  2*a*h
    their reciprocal RMS values, fp32             8

    total: 2*r*h + a*(2*h + 3*h_q + 2*h_kv + 3*f) + 4*heads + 8 (+ the q/k norms' terms)

The q and k norms save their input, a view of the fused projection's output, so the whole of
that output (v's part too) stays until the block's backward. The q/k/v biases save
nothing: their gradient is the output gradient summed over the tokens. GeGLU saves what
SwiGLU saves; gains applied as 1 + w, a scaled embedding and attention sinks add nothing per
token.

A local (sliding-window) layer under a CP ring also keeps, for its backward, the K/V rows it
received from other ranks (its halo: `commvolume.halo_rows` per sequence, 2*h_kv/t*a bytes
each): per local block, not per token (`halo_bytes`).

No s-by-s term: attention runs through flash kernels that keep only the log-sum-exp. For
Llama-3-8B in bf16 (h 4096, h_kv 1024, f 14336, 32 heads) that is 147,592 bytes = 36.0*h per
token, next to Korthikanti et al.'s 34*h for a GPT block with a 4h GELU MLP.

Under ZeRO-0 bf16 (autocast) each block also keeps the bf16 copies of its matmul weights for
backward: 2 bytes per weight, per block not recomputed.

Activation checkpointing:
- selective: the feed-forward half (RMSNorm 2 + SwiGLU, cheap and linear in s) is recomputed;
  attention (quadratic to recompute) is kept. Saved per block: the attention half,
  r*h + a*(h + 3*h_q + 2*h_kv) + 4*heads + 4 (with the q/k norms' terms), plus the
  feed-forward input r*h.
- full: only each block's input r*h is kept; one block is recomputed at a time in backward.

The tiled feed-forward (`Layout.mlp_tile_tokens`, runtime/modeling/tiling.py) keeps of the
feed-forward half only its input r*h (its intermediates live one tile at a time, in forward
and in backward), so without checkpointing a block saves the attention half + r*h, as under
selective checkpointing; selective and full keep what they keep untiled. Offloading
activations (`Layout.offload_activations`, under full checkpointing) leaves on the device only
the last block's input: the others are in host memory (ctxlaunch.perf.hostmemory) until their
block's backward brings them back.

A mixture-of-experts block (model.moe) saves the attention half and, in place of the SwiGLU's
terms, its router's and experts' (ctxlaunch.perf.moecost, at the routing load the planner
admits); its weights are whole on every TP rank. Every block of such a model is planned as a
mixture-of-experts one.

The functions below name these quantities by the table's symbols (a, r, h, h_kv, f).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxlaunch.perf import moecost
from ctxlaunch.perf.commvolume import halo_rows
from ctxlaunch.perf.layout import Layout

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec

# Constants the trainer uses too, so the planner and the run agree.
LOSS_CHUNK_TOKENS = 2048
"""The output head and cross-entropy run over chunks of this many tokens, each recomputed in
backward, so the (tokens x vocab) logits never exist for the whole local sequence at once."""
ATTENTION_TILE_TOKENS = 65536
"""The tile the offload recipe gives the ring's attention backward (`plan.offload_steps`):
long enough that each kernel call still fills the GPU (a 64K x 64K tile of 32 heads is over a
million FlashAttention-2 thread blocks), short enough that on a rank holding hundreds of
thousands of tokens the kernels' gradient buffers become a small share of its memory."""
BACKWARD_CHUNK_TOKENS = 1024
"""The RMSNorm and SwiGLU backward passes compute their fp32 pointwise math over chunks of this
many tokens, so those temporaries do not grow with the sequence."""


def attention_half_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """What the attention half of a block (RMSNorm 1 to the o projection, the block input
    included) saves for backward per token (the table in the module docstring)."""
    # a, r, h, h_q, h_kv: the symbols of the module docstring's table.
    a, r = layout.compute_bytes, layout.residual_bytes
    h, h_q, h_kv = model.hidden, model.q_hidden, model.kv_hidden
    saved = r * h + a * (h + 3 * h_q + 2 * h_kv) + 4 * model.heads + 4
    if model.qk_norm:
        saved += a * (h_q + 2 * h_kv) + 4 * (model.heads + model.kv_heads)
    if model.post_norms:
        saved += a * h + 4  # the norm after attention keeps the o projection's output
    return saved


def block_activation_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Bytes one transformer block saves for backward per token, for the layout's
    checkpointing mode (the table in the module docstring)."""
    # a, r, h, f: the symbols of the module docstring's table.
    a, r = layout.compute_bytes, layout.residual_bytes
    h, f = model.hidden, model.ffn_hidden
    attention_half = attention_half_bytes_per_token(model, layout)
    feed_forward_half: float = r * h + a * (h + 3 * f) + 4
    if model.moe is not None:
        feed_forward_half = r * h + 4 + moecost.feed_forward_bytes_per_token(model, layout)
    if model.post_norms:
        feed_forward_half += a * h + 4  # the norm after the feed-forward keeps its output
    # TP with sequence parallelism divides every per-token tensor by t, the norm outputs the
    # column-parallel projections read included: as in Megatron, each projection keeps its
    # input's local shard and gathers it again in backward (tensor_parallel.gather_linear).
    mode = layout.activation_checkpointing
    if mode == "none" and not layout.mlp_tile_tokens:
        return attention_half + feed_forward_half
    if mode in ("none", "selective"):  # tiled: the feed-forward keeps its input alone
        return attention_half + r * h
    return r * h


def recompute_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """What recomputing one block in backward adds back while it is being differentiated."""
    mode = layout.activation_checkpointing
    if mode == "none":
        return 0.0
    full = block_activation_bytes_per_token(model, layout.replace(activation_checkpointing="none"))
    if mode == "full":
        return full
    selective = block_activation_bytes_per_token(model, layout)
    return full - selective


def attention_workspace_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Transient buffers of one attention call in backward (its peak), per local token:
    fp32 dQ accumulator, K/V grads and their transfer buffers, kernel outputs (those of one
    tile under `Layout.attention_tile_tokens`)."""
    # a, h_q, h_kv: the symbols of the module docstring's table.
    a = layout.compute_bytes
    h_q, h_kv = model.q_hidden, model.kv_hidden
    # dq, dk, dv from the kernel, K/V expanded to all query heads; under attention tiles the
    # ring's kernel calls cover one tile's rows.
    kernel_grads = a * 3 * h_q * layout.attention_tile_fraction
    if layout.dims.cp == 1:
        return kernel_grads
    if layout.dims.cp_algorithm == "ulysses":
        # all-to-all in and out buffers for q, k, v (and their grads): same size per rank.
        return 2 * a * (h_q + 2 * h_kv) + kernel_grads
    if layout.dims.cp_algorithm == "allgather":
        # fp32 dQ; the whole sequence's K/V gathered (cp x the local tokens) and their fp32
        # dK/dV before the reduce-scatter.
        return 4 * h_q + layout.dims.cp * (2 * a * h_kv + 2 * 4 * h_kv) + kernel_grads
    # ring (and the ring part of hybrid): fp32 dQ, fp32 dK/dV in hand and in flight, K/V in
    # hand and in flight.
    return 4 * h_q + 2 * 2 * 4 * h_kv + 2 * 2 * a * h_kv + kernel_grads


def loss_workspace_bytes(model: ModelSpec, layout: Layout) -> float:
    """The chunked loss's transients (runtime/modeling/loss.py: each chunk's backward done in its
    forward): one chunk's logits in the compute dtype, in 16-bit their one fp32 upcast (the
    softmax and then the logits' gradient, formed in place and cast back into the logits'
    buffer; in fp32 the logits themselves are that work), and under autocast the head weight's
    compute-dtype copy (made once for every chunk) and the chunk of the loss input cast to
    it. The per-token statistics (about 50 bytes per token of the chunk) are left out. The
    largest of what follows the softmax (the input gradient's chunk before it is written into
    the fp32 whole, the head gradient's per-chunk product before it is added to the fp32
    accumulator) is smaller than the upcast at any vocabulary above the hidden size."""
    chunk_tokens = min(layout.tokens_per_rank, LOSS_CHUNK_TOKENS)
    vocab_per_rank = model.vocab / layout.dims.tp
    # a, h: the symbols of the module docstring's table.
    a, h = layout.compute_bytes, model.hidden
    if layout.framework != "ctxlaunch":
        # Other frameworks' habits keep the earlier model of a recomputed chunk: logits, their
        # fp32 copy, the fp32 log-softmax and the fp32 logits gradient.
        return (a + 12) * vocab_per_rank * chunk_tokens
    upcast = 4 * vocab_per_rank * chunk_tokens if a != 4 else 0.0
    copies = a * (vocab_per_rank + chunk_tokens) * h if layout.residual_bytes != a else 0.0
    # A final logit soft-cap keeps the chunk's fp32 tanh until its gradient is formed.
    capped = 4 * vocab_per_rank * chunk_tokens if model.logit_softcap is not None else 0.0
    return a * vocab_per_rank * chunk_tokens + upcast + copies + capped


def autocast_weight_copy_bytes(model: ModelSpec, layout: Layout) -> float:
    """ZeRO-0 bf16 runs under autocast: each block's matmuls save the bf16 copies of their fp32
    weights for backward (2 bytes per weight), except where the block is recomputed."""
    if layout.dtype != "bf16" or not layout.fp32_weights:
        return 0.0
    # h, h_q, h_kv, f: the symbols of the module docstring's table.
    h, h_q, h_kv, f = model.hidden, model.q_hidden, model.kv_hidden, model.ffn_hidden
    attention = h * (h_q + 2 * h_kv) + h_q * h
    feed_forward: float = 3 * h * f
    if model.moe is not None:  # whole on every TP rank: its copies' bytes as they are
        feed_forward = moecost.weight_copy_bytes(model, layout) / 2 * layout.dims.tp
    kept: dict[str, float] = {"none": attention + feed_forward, "selective": attention, "full": 0}
    return 2.0 * kept[layout.activation_checkpointing] / layout.dims.tp


def activation_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes saved for backward on the busiest rank (the busiest pipeline stage) at the start
    of backward."""
    if layout.dims.pp == 1:
        return stage_activation_bytes(model, layout, model.layers, first=True, last=True)
    # 1F1B: stage `stage` holds the activations of up to pp - stage micro-batches in flight.
    return max(
        min(layout.dims.pp - stage, layout.grad_accum)
        * stage_activation_bytes(
            model, layout, stage_blocks, first=stage == 0, last=stage == layout.dims.pp - 1
        )
        for stage, stage_blocks in enumerate(layout.rank_layers(model.layers))
    )


def stage_activation_bytes(
    model: ModelSpec, layout: Layout, blocks: int, *, first: bool, last: bool
) -> float:
    """Bytes one micro-batch leaves saved for backward on a pipeline stage of `blocks` blocks
    (with the embedding if `first`, the final norm and the loss if `last`)."""
    tp = layout.dims.tp
    tokens = layout.tokens_per_rank / tp  # per rank, sequence-parallel under TP
    r = layout.residual_bytes  # the table's r
    # Outside the blocks, per sequence-parallel token: the RoPE cos/sin tables (one pair for
    # every block of a kind, over the CP shard's tokens); on the first stage the int64 token ids (and,
    # under TP, the vocabulary mask of the parallel embedding); on the last the final RMSNorm
    # input and rstd, and the gradient of the chunked loss's input (gathered over TP): the loss
    # computes it in forward and keeps it, in place of the input it no longer keeps.
    outside = 2 * model.head_dim * layout.compute_bytes * tp * rope_table_kinds(model)
    if first:
        outside += 8 * tp + (tp if tp > 1 else 0)
    if last:
        outside += r * model.hidden + 4 + r * model.hidden * tp
        if layout.framework != "ctxlaunch":
            outside += 8 * tp  # the int64 targets, which a recomputed loss keeps
    per_block = block_activation_bytes_per_token(model, layout)
    kept_blocks = device_kept_blocks(layout, blocks)
    return (
        tokens * (per_block * kept_blocks + outside)
        + autocast_weight_copy_bytes(model, layout) * blocks
        + halo_bytes(model, layout) * kept_blocks
    )


def rope_table_kinds(model: ModelSpec) -> int:
    """How many pairs of RoPE tables the blocks keep: two where local layers rotate by their
    own base beside full ones, else one."""
    windows = model.layer_windows
    own_base = model.local_rope_theta is not None and any(w is not None for w in windows)
    return 2 if own_base and any(w is None for w in windows) else 1


def halo_bytes(model: ModelSpec, layout: Layout) -> float:
    """The halos one block keeps for backward per micro-batch, averaged over the layers (a
    local layer under a CP ring keeps the K/V rows it received; recomputed with its block
    under full checkpointing, so none stays)."""
    if layout.activation_checkpointing == "full":
        return 0.0
    rows = sum(halo_rows(layout, w) for w in model.layer_windows) / model.layers
    return layout.micro_batch * rows * 2 * model.kv_hidden / layout.dims.tp * layout.compute_bytes


def device_kept_blocks(layout: Layout, blocks: int) -> int:
    """Blocks whose saved activations stay on the device after forward: all of them, or with
    activations offloaded only the last one's (runtime/modeling/offload.py)."""
    return min(blocks, 1) if layout.offload_activations else blocks
