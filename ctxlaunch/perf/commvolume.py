"""Bytes each rank sends per optimizer step, per parallel dimension, for the trainer as built
(pure arithmetic, no torch; a step-time model divides these by link bandwidths).

Collectives are counted as ring algorithms send them (NCCL's and gloo's large-message
algorithms), per rank, for a group of g ranks and a tensor of N bytes:

    all-gather (N the gathered output)       (g - 1) / g * N
    reduce-scatter (N the unreduced input)   (g - 1) / g * N
    all-reduce                               2 * (g - 1) / g * N
    all-to-all (N the input)                 (g - 1) / g * N
    point-to-point send                      N

Per micro-batch, with n = micro_batch * seq_len / cp tokens on a CP rank, t = TP degree,
h = hidden, h_q = query width (heads x head_dim), h_kv = K/V width, a = compute-dtype bytes
(2 bf16, 4 fp32), r = bytes of the residual stream (4 in the bundled trainer: its TP/PP engines
keep fp32 weights, so it is fp32 under autocast too; a under Megatron), per block:

- TP (sequence parallel), Megatron's habits: forward gathers the norm output twice (n*h*r
  each) and reduce-scatters the attention and feed-forward outputs (n*h*a each); backward
  runs the conjugates on the gradients (reduce-scatter n*h*r, all-gather n*h*a):
      4 * (t-1)/t * n*h*(r + a)
  The bundled trainer gathers the norm output in the compute dtype, and again in backward
  (it keeps only the local shard, `gather_linear`); its input gradients are reduce-scattered
  in the stream's dtype: (t-1)/t * n*h*(2*r + 8*a), and its selective / full recomputation
  2 / 4 more compute-dtype collectives.
  plus, once per micro-batch, the embedding's reduce-scatter and its backward all-gather on
  the first stage, the loss input's all-gather and its backward reduce-scatter on the last
  (each (t-1)/t * n*h*4), and the vocabulary-parallel cross-entropy's all-reduces of 3 fp32
  per token, in forward only in the bundled trainer (its chunked loss), run again when the
  chunk is recomputed in backward otherwise:
      2 * (t-1)/t * n*3*4 (x 2 recomputed).
  Recomputation repeats the forward's share: full checkpointing 2 * (t-1)/t * n*h*(r + a)
  more per block, the bundled trainer's selective (the feed-forward half) half that; Megatron's
  selective recomputes only core attention, which sends nothing over TP.
- CP ring of N ranks: K and V of this TP rank's heads (n*h_kv/t*a each) travel N-1 hops in
  forward and again in backward, dK and dV (fp32) N-1 hops in backward:
      2 * (N-1) * n*h_kv/t * (2*a + 4);   full recomputation adds 2*(N-1)*n*h_kv/t*a
  (selective checkpointing keeps attention: nothing more).
- A local (sliding-window) layer under a ring of N ranks sends no hops: each rank receives, per
  chunk it holds (one contiguous, two zigzag or balanced), the w - 1 rows before the chunk that
  another rank holds (at most s - s/N), K and V in one exchange, and sends their fp32 dK/dV
  home in backward; per sequence, with c chunks:
      c * min(w - 1, s - s/N) * h_kv/t * (2*a + 2*4)   (forward again under full recomputation)
  against the full ring's 2 * (N-1) * n*h_kv/t * (2*a + 4). Ulysses' all-to-alls are a full
  layer's (the window applies after them).
- CP Ulysses of degree U: q, k, v to heads and the output back in forward, the same volume in
  backward: 2 * (U-1)/U * n*(2*h_q + 2*h_kv)/t * a, half as much again under full
  recomputation. Hybrid: the Ulysses term with U plus the ring
  term with N = cp / U.
- PP: per micro-batch a stage sends its output activation (n/t*h*r) forward unless it is the
  last stage and the gradient of its input backward unless it is the first.
- DP x CP gradient reduction (ZeRO-0), g = dp * cp: an all-reduce of the rank's fp32 gradients
  once per step, 2*(g-1)/g * 4 * params; TP adds an all-reduce of the replicated RMSNorm gains'
  gradients, 2*(t-1)/t * 4 * norm params. ZeRO-1/2 (as DeepSpeed runs them): a reduce-scatter
  of the a-byte gradients and an all-gather of the a-byte weights, (g-1)/g * 2*a * params;
  ZeRO-3: weights gathered for every micro-batch's forward and backward and gradients
  reduce-scattered, m * (g-1)/g * 3*a * params. (The bundled trainer's FSDP2 under TP or PP is
  counted as DeepSpeed's.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxlaunch.perf.layout import Layout

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec

TRAINER_STREAM_BYTES = 4
"""Bytes per element of the residual stream the bundled trainer sends over TP and PP: fp32, as
its TP/PP engines keep fp32 weights (autocast leaves the residual in fp32)."""


@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends per optimizer step, by dimension."""

    tp: float
    cp: float
    pp: float
    dp: float

    @property
    def total(self) -> float:
        return self.tp + self.cp + self.pp + self.dp


def stream_bytes(layout: Layout) -> int:
    """Bytes per element of the residual-stream tensors sent over TP and PP (r above)."""
    return TRAINER_STREAM_BYTES if layout.framework == "ctxlaunch" else layout.compute_bytes


def _local_tokens(layout: Layout) -> float:
    """Tokens of one micro-batch on a CP rank."""
    return layout.micro_batch * layout.seq_len / layout.dims.cp


def tp_collectives_per_block(layout: Layout) -> tuple[float, float]:
    """(stream-width, compute-width) ring collectives one block runs over TP per micro-batch,
    what recomputation repeats included (see the docstring)."""
    mode = layout.activation_checkpointing
    recompute = {"none": 0.0, "selective": 0.5, "full": 1.0}[mode]
    if layout.framework == "ctxlaunch":
        # Gathers of the compute-dtype norm output (forward, and again in backward), the
        # outputs' reduce-scatters and their gradients' all-gathers in the compute dtype; the
        # input gradients' reduce-scatters in the stream's.
        return 2.0, 8 + 4 * recompute
    if mode == "selective":
        recompute = 0.0  # Megatron's selective recomputes core attention: nothing over TP
    return 4 + 2 * recompute, 4 + 2 * recompute


def tp_message_bytes(model: ModelSpec, layout: Layout, element_bytes: int) -> float:
    """What one rank sends in one TP all-gather or reduce-scatter of the sequence-parallel
    activations (n*h elements of `element_bytes`)."""
    return (
        (layout.dims.tp - 1) / layout.dims.tp * _local_tokens(layout) * model.hidden * element_bytes
    )


def tp_block_bytes(model: ModelSpec, layout: Layout, *, stream: int | None = None) -> float:
    """Bytes one block sends over TP per micro-batch; `stream`: the residual stream's element
    bytes (default `stream_bytes(layout)`)."""
    width = stream_bytes(layout) if stream is None else stream
    n_stream, n_compute = tp_collectives_per_block(layout)
    return n_stream * tp_message_bytes(model, layout, width) + n_compute * tp_message_bytes(
        model, layout, layout.compute_bytes
    )


def tp_edge_bytes(model: ModelSpec, layout: Layout, *, first: bool, last: bool) -> float:
    """Bytes a stage sends over TP per micro-batch outside its blocks: the embedding's and the
    loss input's fp32 collectives, and the vocabulary-parallel cross-entropy's all-reduces."""
    if layout.dims.tp == 1:
        return 0.0
    frac_t = (layout.dims.tp - 1) / layout.dims.tp
    n = _local_tokens(layout)
    # The bundled trainer's chunked loss runs its all-reduces in forward only; a recomputed
    # loss runs them again in backward.
    loss_passes = 1 if layout.framework == "ctxlaunch" else 2
    return (
        2 * frac_t * n * model.hidden * 4 * (first + last)
        + loss_passes * 2 * frac_t * n * 3 * 4 * last
    )


def ring_hop_bytes(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per ring hop per block: K and V of its heads
    forward; K and V again and fp32 dK/dV backward."""
    kv_local = _local_tokens(layout) * model.kv_hidden / layout.dims.tp
    forward = 2 * kv_local * layout.compute_bytes
    return forward, forward * (1 + 4 / layout.compute_bytes)


def allgather_bytes(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes one rank receives per block under all-gather CP: the K and V
    of the other cp - 1 ranks forward (an all-gather; the gathered copy is kept for backward),
    their fp32 dK/dV backward (a reduce-scatter of the same elements)."""
    kv_others = (layout.dims.cp - 1) * _local_tokens(layout) * model.kv_hidden / layout.dims.tp
    return 2 * kv_others * layout.compute_bytes, 2 * kv_others * 4


def ring_forwards(layout: Layout) -> int:
    """Forward passes of attention per micro-batch: two under full recomputation."""
    return 2 if layout.activation_checkpointing == "full" else 1


def ulysses_all_to_all_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes one rank sends in one direction of a block's Ulysses all-to-alls (q, k, v to
    heads, or the output back): (U-1)/U * n*(2h_q + 2h_kv)/t * a (h_q = heads x head_dim)."""
    u = layout.dims.ulysses_degree
    return (
        (u - 1)
        / u
        * _local_tokens(layout)
        * (2 * model.q_hidden + 2 * model.kv_hidden)
        / layout.dims.tp
        * layout.compute_bytes
    )


def ulysses_passes(layout: Layout) -> float:
    """All-to-all passes per block and micro-batch: forward and backward, half again when
    attention is recomputed."""
    return 2 * (1.5 if layout.activation_checkpointing == "full" else 1.0)


def cp_block_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes one block sends over CP per micro-batch: the ring's hops and the Ulysses
    all-to-alls (hybrid: both), or all-gather CP's gather and reduce-scatter (a ring
    all-gather sends what it receives)."""
    if layout.dims.cp == 1:
        return 0.0
    if layout.dims.cp_algorithm == "allgather":
        forward, backward = allgather_bytes(model, layout)
        return ring_forwards(layout) * forward + backward
    ring = layout.dims.ring_degree
    forward, backward = ring_hop_bytes(model, layout)
    ring_bytes = (ring - 1) * (ring_forwards(layout) * forward + backward)
    ulysses = (
        ulysses_passes(layout) * ulysses_all_to_all_bytes(model, layout)
        if layout.dims.ulysses_degree > 1
        else 0.0
    )
    return ring_bytes + ulysses


def halo_rows(layout: Layout, window: int | None) -> float:
    """K/V rows one ring rank receives per sequence in a local layer's halo exchange (the
    busiest rank: every chunk it holds needs the window - 1 rows before it, at most what the
    other ranks hold); 0 without a ring or with a window the sequence fits in."""
    ring = layout.dims.ring_degree
    if ring <= 1 or window is None or window >= layout.seq_len:
        return 0.0
    chunks = 1 if layout.dims.cp_sharding == "contiguous" else 2
    return chunks * min(window - 1, layout.seq_len - layout.seq_len / ring)


def halo_exchange_bytes(model: ModelSpec, layout: Layout, window: int) -> float:
    """Bytes of one local block's halo exchanges per micro-batch: K and V rows forward (again
    in a recomputed forward) and their fp32 gradients home in backward."""
    rows = layout.micro_batch * halo_rows(layout, window)
    row = model.kv_hidden / layout.dims.tp
    forward, backward = 2 * rows * row * layout.compute_bytes, 2 * rows * row * 4
    return ring_forwards(layout) * forward + backward


def halo_block_bytes(model: ModelSpec, layout: Layout, window: int) -> float:
    """Bytes one local block sends over CP per micro-batch: its halo exchanges, and Ulysses'
    all-to-alls as a full block's (hybrid)."""
    ulysses = (
        ulysses_passes(layout) * ulysses_all_to_all_bytes(model, layout)
        if layout.dims.ulysses_degree > 1
        else 0.0
    )
    return halo_exchange_bytes(model, layout, window) + ulysses


def layer_cp_bytes(model: ModelSpec, layout: Layout) -> list[float]:
    """Bytes each layer sends over CP per micro-batch: a full layer's ring or all-to-all, a
    local layer's halo exchange (all-gather CP gathers every layer's K/V alike)."""
    full = cp_block_bytes(model, layout)
    if layout.dims.cp == 1 or layout.dims.cp_algorithm == "allgather":
        return [full] * model.layers
    return [
        full if w is None or w >= layout.seq_len else halo_block_bytes(model, layout, w)
        for w in model.layer_windows
    ]


def pp_message_bytes(model: ModelSpec, layout: Layout, *, stream: int | None = None) -> float:
    """Bytes of one activation (or its gradient) sent between pipeline stages."""
    width = stream_bytes(layout) if stream is None else stream
    return _local_tokens(layout) * model.hidden / layout.dims.tp * width


def dp_step_bytes(
    layout: Layout, params: float, *, norm_params: float = 0, grad_bytes: int | None = None
) -> float:
    """Bytes one rank sends per step reducing gradients (and gathering weights) over the DP x CP
    replicas, for `params` parameters held (`norm_params` of them replicated over TP);
    `grad_bytes`: the gradients' element bytes (default fp32 under ZeRO-0, else the compute
    dtype)."""
    g = layout.dims.dp * layout.dims.cp
    a = layout.compute_bytes
    grads = (4 if layout.zero_stage == 0 else a) if grad_bytes is None else grad_bytes
    share = (g - 1) / g
    if layout.zero_stage == 0:
        volume = 2 * share * params * grads
    elif layout.zero_stage in (1, 2):
        volume = share * params * (grads + a)
    else:
        volume = layout.grad_accum * share * params * (2 * a + grads)
    # The step's predicted-token count (the loss's divisor): one int64 all-reduced over DP x CP.
    volume += 2 * share * 8
    frac_t = (layout.dims.tp - 1) / layout.dims.tp
    return volume + (2 * frac_t * 4 * norm_params if norm_params else 0.0)


def step_comm_bytes(
    model: ModelSpec,
    layout: Layout,
    *,
    blocks: int | None = None,
    first_stage: bool = True,
    last_stage: bool = True,
    stage_params: int = 0,
    norm_params: int = 0,
) -> CommVolume:
    """Bytes sent per optimizer step by one rank of a pipeline stage holding `blocks` blocks
    (default: all), per dimension; see the module docstring for each term.
    `stage_params`: parameters this rank holds (its TP slice of its stages) for the DP term;
    `norm_params`: the RMSNorm gains among them (replicated over TP)."""
    layers = model.layers if blocks is None else blocks
    m = layout.grad_accum
    tp_bytes = 0.0
    if layout.dims.tp > 1:
        tp_bytes = m * (
            layers * tp_block_bytes(model, layout)
            + tp_edge_bytes(model, layout, first=first_stage, last=last_stage)
        )
    per_layer = layer_cp_bytes(model, layout)
    cp_bytes = m * layers * cp_block_bytes(model, layout)
    if len(set(per_layer)) > 1:  # local layers: a stage's blocks, each the average layer's
        cp_bytes = m * layers * sum(per_layer) / len(per_layer)
    pp_bytes = m * pp_message_bytes(model, layout) * ((not last_stage) + (not first_stage))
    dp_bytes = dp_step_bytes(layout, stage_params, norm_params=norm_params)
    return CommVolume(tp=tp_bytes, cp=cp_bytes, pp=pp_bytes, dp=dp_bytes)
