"""The step-time model: how long one optimizer step takes for a layout, term by term.

Pure arithmetic over the layout (`Layout`) and the machine (`Machine`: GPU and fabric
tables, or the constants `ctxlaunch calibrate` measured on a CPU); no I/O, no torch. `plan`,
`advise`, `report` and the CPU self-check all call `predict`.

One rank of the busiest pipeline stage, one micro-batch of b sequences of s tokens; n = b*s/cp
tokens held by the rank (CP splits the sequence), TP shards heads and weights:

  compute      every projection's three GEMMs (forward, input and weight gradient; +1 forward
               for what the checkpointing mode recomputes) timed by shape
               (profiles.gemm_seconds: eta_matmul x the precision's peak over the last
               wave's occupancy of the SMs, or the GEMM's HBM traffic where larger); causal
               attention's score entries (12 x head_dim FLOPs each, +4 when recomputed) at the
               flash kernel's measured rate with its length ramp, plus exposed exponentials
               for FA2-generation kernels (profiles.attention_seconds); elementwise work
               (norms, RoPE, SwiGLU, residuals, casts) as HBM traffic: 3 passes (forward
               write, backward read and gradient write) over the bytes a block saves per
               token, at the profile's fraction of the HBM bandwidth; the loss's passes over
               its logits (LOSS_BYTES_PER_LOGIT per token and vocabulary entry the rank
               holds, on the last stage) at the profile's loss rate.
  TP           Megatron sequence parallelism: per layer 2 all-gathers + 2 reduce-scatters in
               forward, as many in backward (and again in a recomputed forward), each moving
               (t-1)/t x n*h*2 bytes; not overlapped.
  CP ring      r-1 hops per layer; per hop a rank sends its K/V block (2 x n_ring x h_kv/t
               x 2 bytes) in forward, K/V and dK/dV (fp32) in backward, while it computes the
               attention of the block in hand (its attention work / r). Only the part of each
               transfer longer than that compute is exposed.
  all-gather   (Llama 3's CP) per layer the K/V of the other cp - 1 ranks all-gathered before
               attention (again in a recomputed forward) and their fp32 dK/dV reduce-scattered
               after its backward, not overlapped; the rank's attention runs as one call over
               the whole sequence's keys (the length ramp of s tokens, not of s/cp).
  Ulysses      two all-to-alls per layer in forward (q, k, v in; out back), two in backward:
               (u-1)/u x n x (2h + 2h_kv)/t x 2 bytes each way; not overlapped. Hybrid:
               Ulysses over u ranks inside, a ring over cp/u outside.
  PP           the schedule's bubble: (p-1)/v micro-batch times on top of the m micro-batches
               (1F1B: v = 1; interleaved: v virtual stages per rank) [Narayanan et al. 2021];
               activations sent between stages during fill and drain.
  DP / ZeRO    over the DP x CP ranks holding replicas: all-reduce of the gradients (ZeRO-0),
               reduce-scatter of the gradients + all-gather of the weights (ZeRO-1/2), and under
               ZeRO-3 the weights gathered for every micro-batch's forward and backward. Where
               the framework overlaps them (`Machine.overlap_dp`) they hide behind one
               micro-batch of compute; only the rest is exposed.
  optimizer    Adam reads and writes ~32 bytes per parameter the rank updates, at HBM speed;
               offloaded (training.offload.optimizer), at the rank's share of its node's
               host memory bandwidth (CPU Adam, FSDP2's AdamW on the host).
  host copies  offloading's copies over the GPU's host link (PCIe, both directions at once):
               each micro-batch the block inputs out in forward and back in backward, the
               offloaded parameters fetched for forward and backward, the gradients out to
               the host; they run on side streams, so each direction hides behind its phase's
               compute (forward a third of it, backward two thirds) and only the excess is
               exposed; after the step the updated 16-bit weights come back, exposed.
               The tiled feed-forward adds one forward of the feed-forward projections.
  overhead     a fixed cost per micro-batch (Python dispatch, data, bookkeeping: measured on
               the CPU and by a GPU calibration, the bundled profile's from its H200 one; 0
               under the Megatron profile), and on the CPU a cost per blocking
               synchronisation (ring hop, all-to-all, all-reduce) that compute cannot hide,
               growing as the square root of the compute between two of them (the straggler
               gap of ranks whose compute other processes delay at random; where ranks can
               outnumber cores, a peer may not be scheduled); 0 on GPUs.

Collectives move bytes at eta_comm x the data-sheet bandwidth of the slowest link their group
spans (NVLink inside the NVLink domain; the network beyond it, one NIC per GPU) plus one
latency per ring step. Every constant is a data-sheet value (ctxlaunch.contract.hardware),
measured (ctxlaunch.runtime.calibration on the CPU; an H200 calibration for the GPU profiles),
or one of the fitted constants of a framework profile (ctxlaunch.perf.profiles, whose data
files say where each comes from); docs/concepts/step-time-model.md lists which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ctxlaunch.contract.hardware import LinkInfo
from ctxlaunch.perf import commvolume, moecost
from ctxlaunch.perf.activations import block_activation_bytes_per_token
from ctxlaunch.perf.flops import (
    CONVENTIONS,
    MfuConvention,
    attention_keys_per_token,
    count_params,
    flops_per_token,
    window_attention_fraction,
)
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine, Provenance, machine_for
from ctxlaunch.perf.modelstates import params_per_rank
from ctxlaunch.perf.profiles import attention_seconds, gemm_seconds

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec, ModelSpec

ELEMENTWISE_HBM_PASSES = 3.0
LOSS_BYTES_PER_LOGIT = {2: 52.0, 4: 40.0}
"""HBM bytes the bundled trainer's chunked loss (runtime/modeling/loss.py) moves per logit, by
the compute dtype's width, outside its two GEMMs. 16-bit: the fp32 upcast (read 2, write 4),
the row maximum (4), subtracting it (8), exp (8), the row sum (4), the divide (8), the scale
(8), and the cast back for the gradient GEMMs (read 4, write 2): 52. fp32 computes in the
logits' own buffer: no upcast and no cast back, 40. A 128K vocabulary makes this 6.7 MB per
token in bf16, as much traffic as a 1B model's sixteen blocks together."""
OPTIMIZER_BYTES_PER_PARAM = 32.0


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step, by term (seconds per step)."""

    terms: dict[str, float]
    step_seconds: float
    tokens_per_second_per_gpu: float
    model_flops_per_second_per_gpu: dict[MfuConvention, float]
    mfu: dict[MfuConvention, float]
    detail: dict[str, float] = field(default_factory=dict)
    """Per-layer figures behind the terms (ring hop transfer vs hop compute, ...)."""
    framework: str = "ctxlaunch"
    """Whose kernels and overlap were timed (ctxlaunch.perf.profiles)."""
    expected_error: float = 0.0
    """The constants' relative error measured on their own machine (0: none known here)."""
    provenance: Provenance = field(default_factory=lambda: Provenance("profile", ""))
    """Where the machine's constants come from (machine.Provenance)."""

    def range_text(self) -> str:
        """The prediction's expected error in words, for `plan` and `advise`."""
        if not self.provenance.calibrated:
            return f"uncalibrated here: {self.provenance.note}; {self.provenance.calibrate}"
        if not self.expected_error:
            return f"{self.framework} profile, expected error not measured"
        return (
            f"+/-{self.expected_error:.0%} expected ({self.provenance.note}; the docs' step-time "
            "model page says where the range comes from)"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "step_seconds": self.step_seconds,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "model_tflops_per_gpu": {
                c: v / 1e12 for c, v in self.model_flops_per_second_per_gpu.items()
            },
            "mfu": self.mfu,
            "terms_seconds": self.terms,
            "detail": self.detail,
            "framework": self.framework,
            "expected_error": self.expected_error,
            "calibration": {
                "state": self.provenance.state,
                "calibrated": self.provenance.calibrated,
                "note": self.provenance.note,
                "calibrate": self.provenance.calibrate,
            },
        }


def _collective_seconds(volume_bytes: float, steps: int, link: LinkInfo, machine: Machine) -> float:
    if steps <= 0 or volume_bytes <= 0:
        return 0.0
    return volume_bytes / machine.bandwidth(link) + steps * link.latency_seconds


def _matmul_seconds(
    model: ModelSpec, layout: Layout, machine: Machine, tokens: float, layers: float, vocab: float
) -> tuple[float, float]:
    """(seconds, FLOPs) of one micro-batch's weight matmuls on the busiest stage: every
    projection's forward, input-gradient and weight-gradient GEMM at its own shape
    (`profiles.gemm_seconds`: wave quantisation, memory-bound small GEMMs), TP-sharded, plus a
    recomputed forward of what the checkpointing mode recomputes; the output head once.
    `tokens`: the rank's tokens of the micro-batch; `layers`: the stage's blocks."""
    # h, f, h_q, h_kv: the hidden, feed-forward, query and K/V widths; t: the TP degree.
    h, f, t = model.hidden, model.ffn_hidden, layout.dims.tp
    h_q, h_kv = model.q_hidden, model.kv_hidden
    precision = layout.matmul_precision
    element = 1.0 if precision == "fp8" else float(layout.compute_bytes)

    def gemm(rows: float, cols: float, inner: float) -> float:
        return gemm_seconds(
            rows,
            cols,
            inner,
            peak=machine.peak_flops[precision],
            eta=machine.eta_matmul[precision],
            sm_count=machine.sm_count,
            hbm_bytes_per_second=machine.memory_bytes_per_second,
            element_bytes=element,
        )

    def projection(d_in: float, d_out: float, forwards: int) -> float:
        forward = gemm(tokens, d_out, d_in)
        return forwards * forward + gemm(tokens, d_in, d_out) + gemm(d_in, d_out, tokens)

    mode = layout.activation_checkpointing
    tiled = 1 if layout.mlp_tile_tokens else 0  # the tiles run forward again in backward
    attention_forwards = 2 if mode == "full" else 1
    ffn_forwards = (1 if mode == "none" else 2) + tiled
    block = (
        projection(h, (h_q + 2 * h_kv) / t, attention_forwards)  # fused q, k, v
        + projection(h_q / t, h, attention_forwards)  # output
        + projection(h, 2 * f / t, ffn_forwards)  # fused gate, up
        + projection(f / t, h, ffn_forwards)
    )  # down
    head = projection(h, vocab / t, 1)
    attention_weights, ffn_weights = 2 * h * h_q + 2 * h * h_kv, 3 * h * f
    if model.moe is not None:
        # The experts' GEMMs over the rows routed to the rank (each TP rank its own tokens,
        # whole weights), at the routing load the planner admits; the router; the shared
        # expert. Counted over the active parameters, as the model's FLOPs are.
        moe = model.moe
        routed = tokens / t * moe.experts_per_token * moecost.routed_load(model, layout)
        fe, shared = moe.ffn_hidden, moe.shared_ffn_hidden if model.shared_expert else None

        def rows(count: float, d_in: float, d_out: float, forwards: int) -> float:
            forward = gemm(count, d_out, d_in)
            return forwards * forward + gemm(count, d_in, d_out) + gemm(d_in, d_out, count)

        block -= projection(h, 2 * f / t, ffn_forwards) + projection(f / t, h, ffn_forwards)
        block += (
            rows(routed, h, 2 * fe, ffn_forwards)
            + rows(routed, fe, h, ffn_forwards)
            + rows(tokens / t, h, moe.experts, ffn_forwards)
        )
        ffn_weights = moe.experts_per_token * 3 * h * fe + moe.experts * h
        if shared:
            block += rows(tokens / t, h, 2 * shared, ffn_forwards)
            block += rows(tokens / t, shared, h, ffn_forwards)
            ffn_weights += 3 * h * shared + h
    recompute = {"none": 0, "selective": ffn_weights, "full": attention_weights + ffn_weights}[mode]
    recompute += tiled * ffn_weights
    flops = (
        tokens * layers * (6 * (attention_weights + ffn_weights) + 2 * recompute)
        + 6 * tokens * h * vocab
    ) / t
    return layers * block + head, flops


# --------------------------------------------------------------------------------------------
# one micro-batch on the busiest stage: compute, then TP and CP communication
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shape:
    """What every term of one micro-batch reads of the layout."""

    tokens_per_rank: float
    """Tokens of the micro-batch the rank holds (CP splits the sequence)."""
    layers_per_stage: float
    ring_blocks: int
    """Key blocks a rank's attention runs over per layer, one call each: the ring's degree (a
    block per hop), 1 under all-gather CP (one call over the gathered K/V)."""
    allgather: bool

    @classmethod
    def of(cls, model: ModelSpec, layout: Layout) -> _Shape:
        allgather = layout.dims.cp_algorithm == "allgather" and layout.dims.cp > 1
        return cls(
            tokens_per_rank=layout.micro_batch * layout.seq_len / layout.dims.cp,
            layers_per_stage=model.layers / layout.dims.pp,
            ring_blocks=1 if allgather else layout.dims.ring_degree,
            allgather=allgather,
        )


def _attention_compute_seconds(
    model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape
) -> float:
    """Causal attention with balanced (zigzag) sharding: each token attends to s/2 keys on
    average; forward 4*h*s_keys, backward 8*h*s_keys, a recomputed forward 4 more. A document
    mask computes `attended_fraction` of that area on average, and the ring's busiest rank,
    which every rank waits for, `attention_imbalance` times that (1 under the balanced
    sharding); the diagonal tiles a causal kernel wastes stay the same in total (each
    document's causal call wastes in proportion to its length). Local layers compute only
    their window's band (`flops.window_attention_fraction`)."""
    keys = layout.seq_len / 2 * window_attention_fraction(model, layout.seq_len)
    flops_per_entry = 12 + (4 if layout.activation_checkpointing == "full" else 0)
    entries = (
        shape.tokens_per_rank
        * shape.layers_per_stage
        * model.heads
        / layout.dims.tp
        * keys
        * (
            layout.attended_fraction * layout.attention_imbalance
            + machine.causal_tile_tokens / layout.seq_len
        )
    )
    attention_flops = entries * flops_per_entry * model.head_dim
    if machine.attention_flops_per_second:  # measured (the CPU calibration)
        # The bundled trainer's calls: the whole sequence (CP 1, Ulysses), a ring block of
        # s / r tokens, or a zigzag ring's half-blocks of s / 2r; shorter calls run slower.
        ring_blocks = shape.ring_blocks
        call_tokens = (
            layout.seq_len
            / ring_blocks
            / (2 if ring_blocks > 1 and layout.dims.cp_sharding == "zigzag" else 1)
        )
        ramp = 1.0 + machine.attention_ramp_tokens / call_tokens
        return attention_flops * ramp / machine.attention_flops_per_second
    # One call covers the tokens a ring rank holds (Ulysses gathers the whole sequence over
    # fewer heads). Under all-gather CP a rank's queries run over the whole gathered
    # sequence's keys, as long a key loop per query tile as a call over all s tokens (ring
    # degree 1): the ramp is that of the whole sequence.
    return attention_seconds(
        entries,
        model.head_dim,
        layout.seq_len / shape.ring_blocks,
        peak=machine.peak_flops["bf16" if layout.dtype == "bf16" else "fp32"],
        fraction=machine.eta_attention,
        ramp_tokens=machine.attention_ramp_tokens,
        sfu_ops_per_second=machine.sfu_ops_per_second,
        exp_exposed=machine.exp_exposed,
        matmul_flops_per_entry=flops_per_entry,
    )


def _elementwise_rate(machine: Machine) -> float:
    return machine.elementwise_bytes_per_second or machine.memory_bytes_per_second


def _elementwise_seconds(
    model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape
) -> float:
    """Elementwise traffic of one whole block per token, TP-sharded: the block's own tensors,
    not the copies a TP or FSDP2 trainer keeps around it (gathered norm outputs, fp32
    residual), which the published runs' frameworks do not make."""
    # The whole block's tensors, untiled: tiling changes what is kept, not what is computed.
    saved = block_activation_bytes_per_token(
        model,
        layout.with_dims(tp=1, pp=1).replace(activation_checkpointing="none", mlp_tile_tokens=0),
    )
    passes = (
        ELEMENTWISE_HBM_PASSES
        + {"none": 0.0, "selective": 0.5, "full": 1.0}[layout.activation_checkpointing]
    )
    return (
        shape.tokens_per_rank
        * shape.layers_per_stage
        * saved
        * passes
        / layout.dims.tp
        / _elementwise_rate(machine)
    )


def _loss_seconds(model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape) -> float:
    """The loss's passes over the logits the rank holds. It runs on the last stage only, which
    the busiest stage is taken to be under PP."""
    return (
        shape.tokens_per_rank
        * model.vocab
        / layout.dims.tp
        * LOSS_BYTES_PER_LOGIT[2 if layout.compute_bytes <= 2 else 4]
        / (machine.loss_bytes_per_second or _elementwise_rate(machine))
    )


# Every volume below is commvolume's (checked against the trainer's real traffic).
def _stream_bytes(layout: Layout) -> int:
    """The width the residual-stream tensors sent over TP and PP are timed at: the compute
    dtype's, as Megatron sends them and the efficiencies were fitted. The bundled trainer sends
    them in fp32 (commvolume.stream_bytes), which this model does not yet charge."""
    return layout.compute_bytes


def _tp_seconds(model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape) -> float:
    """Megatron sequence parallelism's all-gathers and reduce-scatters, not overlapped."""
    tp = layout.dims.tp
    if tp <= 1:
        return 0.0
    link = machine.link_for_span(tp)
    stream_collectives, compute_collectives = commvolume.tp_collectives_per_block(layout)
    return shape.layers_per_stage * (
        stream_collectives
        * _collective_seconds(
            commvolume.tp_message_bytes(model, layout, _stream_bytes(layout)), tp - 1, link, machine
        )
        + compute_collectives
        * _collective_seconds(
            commvolume.tp_message_bytes(model, layout, layout.compute_bytes), tp - 1, link, machine
        )
    )


def _ulysses_seconds(model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape) -> float:
    """Ulysses' all-to-alls, not overlapped."""
    ulysses_degree = layout.dims.ulysses_degree
    if ulysses_degree <= 1:
        return 0.0
    link = machine.link_for_span(layout.dims.tp * ulysses_degree)
    return (
        shape.layers_per_stage
        * commvolume.ulysses_passes(layout)
        * _collective_seconds(
            commvolume.ulysses_all_to_all_bytes(model, layout), ulysses_degree - 1, link, machine
        )
    )


def _ep_all_to_all_seconds(
    model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape
) -> float:
    """Expert parallelism's dispatch and combine (forward and backward, again in a recomputed
    forward), not overlapped, over the links an EP group spans (ep ranks tp apart)."""
    if layout.dims.ep <= 1:
        return 0.0
    recompute = 1.5 if layout.activation_checkpointing != "none" else 1.0
    link = machine.link_for_span(layout.dims.ep * layout.dims.tp)
    moe_layers = shape.layers_per_stage * count_params(model).moe_layers / model.layers
    per_layer = _collective_seconds(
        moecost.all_to_all_bytes(model, layout), 4 * (layout.dims.ep - 1), link, machine
    )
    return moe_layers * recompute * per_layer


def _ring_seconds(
    model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape, attention_compute: float
) -> tuple[float, float, float]:
    """(exposed seconds, one forward hop's transfer, one forward hop's compute) of the ring:
    each hop's transfer against the attention of the block in hand, only the excess exposed.
    The ring's layers are the full ones; a local layer's one halo exchange flies beside its
    own block's attention (`_halo_seconds`)."""
    ring_blocks = shape.ring_blocks
    if ring_blocks <= 1:
        return 0.0, 0.0, 0.0
    full_layers = sum(w is None or w >= layout.seq_len for w in model.layer_windows)
    local_share = 1 - full_layers / model.layers
    link = machine.link_for_span(layout.dims.tp * layout.dims.cp)
    hop_bytes_fwd, hop_bytes_bwd = commvolume.ring_hop_bytes(model, layout)
    hop_transfer_fwd = _collective_seconds(hop_bytes_fwd, 1, link, machine)
    hop_transfer_bwd = _collective_seconds(hop_bytes_bwd, 1, link, machine)
    attention_fwd_layer = (
        attention_compute
        / shape.layers_per_stage
        / (3 + (1 if layout.activation_checkpointing == "full" else 0))
    )
    if local_share:
        # A full layer's share of the attention computed: local layers compute their band.
        keys = [attention_keys_per_token(layout.seq_len, w, "causal") for w in model.layer_windows]
        attention_fwd_layer *= layout.seq_len / 2 / sum(keys) * model.layers
    hop_compute_fwd = attention_fwd_layer / ring_blocks
    exposed_fwd = max(0.0, hop_transfer_fwd - hop_compute_fwd)
    exposed_bwd = max(0.0, hop_transfer_bwd - 2 * hop_compute_fwd)
    exposed = (
        shape.layers_per_stage
        * (1 - local_share)
        * (ring_blocks - 1)
        * (commvolume.ring_forwards(layout) * exposed_fwd + exposed_bwd)
    )
    if local_share:
        exposed += (
            shape.layers_per_stage
            * local_share
            * _halo_seconds(model, layout, machine, attention_compute / shape.layers_per_stage)
        )
    return exposed, hop_transfer_fwd, hop_compute_fwd


def _halo_seconds(
    model: ModelSpec, layout: Layout, machine: Machine, attention_compute: float
) -> float:
    """A local layer's exposed halo exchanges per micro-batch: the forward exchange (again when
    recomputed) against the layer's forward attention, the gradients' against its backward
    (the exchange flies beside the own block, most of a local layer's attention)."""
    windows = [w for w in model.layer_windows if w is not None and w < layout.seq_len]
    if not windows:
        return 0.0
    window = sum(windows) / len(windows)
    rows = layout.micro_batch * commvolume.halo_rows(layout, round(window))
    row = model.kv_hidden / layout.dims.tp
    link = machine.link_for_span(layout.dims.tp * layout.dims.cp)
    forward = _collective_seconds(2 * rows * row * layout.compute_bytes, 1, link, machine)
    backward = _collective_seconds(2 * rows * row * 4, 1, link, machine)
    # This layer's share of the attention computed (by its keys per token).
    keys = [attention_keys_per_token(layout.seq_len, w, "causal") for w in model.layer_windows]
    local = attention_compute * attention_keys_per_token(layout.seq_len, round(window), "causal")
    local /= sum(keys)
    passes = 3 + (1 if layout.activation_checkpointing == "full" else 0)
    local_forward = local / passes
    return commvolume.ring_forwards(layout) * max(0.0, forward - local_forward) + max(
        0.0, backward - 2 * local_forward
    )


def _allgather_seconds(model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape) -> float:
    """All-gather CP (Llama 3): K/V gathered from the cp - 1 other ranks before each layer's
    attention, dK/dV reduce-scattered after its backward; on the critical path, not
    overlapped (arXiv:2407.21783, section 3.3.2: "the all-gather communication latency is
    exposed in the critical path")."""
    if not shape.allgather:
        return 0.0
    cp = layout.dims.cp
    link = machine.link_for_span(layout.dims.tp * cp)
    gather_bytes, scatter_bytes = commvolume.allgather_bytes(model, layout)
    return shape.layers_per_stage * (
        commvolume.ring_forwards(layout) * _collective_seconds(gather_bytes, cp - 1, link, machine)
        + _collective_seconds(scatter_bytes, cp - 1, link, machine)
    )


@dataclass(frozen=True)
class _MicroBatchTime:
    """One micro-batch on the busiest stage, seconds by term."""

    matmul: float
    attention: float
    elementwise: float
    loss: float
    tp: float
    ulysses: float
    ring: float
    allgather: float
    ring_hop_transfer: float
    ring_hop_compute: float

    @property
    def total(self) -> float:
        return (
            self.matmul
            + self.attention
            + self.elementwise
            + self.loss
            + self.tp
            + self.ulysses
            + self.ring
            + self.allgather
        )


def _micro_batch_time(
    model: ModelSpec, layout: Layout, machine: Machine, shape: _Shape
) -> _MicroBatchTime:
    counts = count_params(model)
    head_weights = counts.head or counts.embedding
    matmul, _ = _matmul_seconds(
        model,
        layout,
        machine,
        shape.tokens_per_rank,
        shape.layers_per_stage,
        head_weights / model.hidden,
    )
    attention = _attention_compute_seconds(model, layout, machine, shape)
    ring, hop_transfer, hop_compute = _ring_seconds(model, layout, machine, shape, attention)
    return _MicroBatchTime(
        matmul=matmul,
        attention=attention,
        elementwise=_elementwise_seconds(model, layout, machine, shape),
        loss=_loss_seconds(model, layout, machine, shape),
        tp=_tp_seconds(model, layout, machine, shape),
        ulysses=_ulysses_seconds(model, layout, machine, shape),
        ring=ring,
        allgather=_allgather_seconds(model, layout, machine, shape),
        ring_hop_transfer=hop_transfer,
        ring_hop_compute=hop_compute,
    )


def _syncs_per_micro_batch(layout: Layout, shape: _Shape) -> float:
    """Blocking synchronisations of one micro-batch (TP collectives, all-to-alls, ring hops,
    gathers): what the CPU's per-synchronisation cost is charged on."""
    forwards = commvolume.ring_forwards(layout)
    ring_blocks = shape.ring_blocks
    return shape.layers_per_stage * (
        (forwards * 4 + 4 if layout.dims.tp > 1 else 0)
        + (2 * forwards + 2 if layout.dims.ulysses_degree > 1 else 0)
        + ((ring_blocks - 1) * (forwards + 1) if ring_blocks > 1 else 0)
        + (forwards + 1 if shape.allgather else 0)
    )


# --------------------------------------------------------------------------------------------
# the step: the pipeline, DP / ZeRO and the optimizer
# --------------------------------------------------------------------------------------------
def _pipeline_seconds(
    model: ModelSpec, layout: Layout, machine: Machine, micro_batch_seconds: float
) -> tuple[float, float]:
    """(bubble, point-to-point) seconds of the pipeline schedule: (p-1)/v micro-batch times on
    top of the micro-batches, and the activations sent between stages during fill and drain."""
    pp = layout.dims.pp
    if pp <= 1:
        return 0.0, 0.0
    bubble = (pp - 1) / layout.dims.virtual_stages * micro_batch_seconds
    link = machine.link_for_span(layout.dims.tp * layout.dims.cp * layout.dims.dp * pp)
    message = commvolume.pp_message_bytes(model, layout, stream=_stream_bytes(layout))
    return bubble, 2 * (pp - 1) * _collective_seconds(message, 1, link, machine)


def _dp_seconds(layout: Layout, machine: Machine, params: int) -> float:
    """The gradient and weight collectives over the DP x CP replicas, before any overlap."""
    group = layout.dims.dp * layout.dims.cp
    if group <= 1:
        return 0.0
    tp_cp = layout.dims.tp * layout.dims.cp
    link = machine.link_for_span(tp_cp * layout.dims.dp)  # DP ranks are tp x cp apart
    # Across nodes, the group's members in one node reduce there first and then use as
    # many NICs in parallel (NCCL's hierarchical rings).
    in_node = max(1, machine.gpus_per_node // tp_cp)
    bandwidth_scale = in_node if link is machine.network else 1
    volume = commvolume.dp_step_bytes(layout, params)
    steps = 2 * (group - 1) if layout.zero_stage < 3 else 3 * layout.grad_accum * (group - 1)
    return _collective_seconds(volume / bandwidth_scale, steps, link, machine)


@dataclass(frozen=True)
class _HostCopies:
    """Offloading's copies over the host link, seconds before overlap, and exposed."""

    total: float
    exposed: float
    optimizer_on_host: float


def _host_copies(
    model: ModelSpec, layout: Layout, machine: Machine, micro_seconds: float, params: int
) -> _HostCopies:
    """The host copies of one step (see the module docstring) and an offloaded optimizer's
    step on the host."""
    if not layout.offloads:
        return _HostCopies(0.0, 0.0, 0.0)
    rate = machine.host_copy_bytes_per_second()
    shard = params / layout.dims.shard_group
    weight = 2 if layout.dtype == "bf16" else 4
    blocks = layout.rank_layers(model.layers)[0] if layout.dims.pp > 1 else model.layers
    activations = (
        max(blocks - 1, 0) * layout.tokens_per_rank / layout.dims.tp * model.hidden
        if layout.offload_activations
        else 0.0
    ) * layout.residual_bytes
    fetched = gradients = update = 0.0
    if layout.offload_optimizer and layout.zero_stage >= 1:
        if layout.fsdp:  # fp32 shards gathered from the host, fp32 gradient shards back
            fetched = 4 * shard * (2 if layout.zero_stage == 3 else 1)
            gradients = 4 * shard
        else:
            gradients = weight * shard
            if layout.offload_parameters:
                fetched = 2 * weight * shard  # forward and backward
            else:
                update = weight * shard
    forward, backward = micro_seconds / 3, 2 * micro_seconds / 3
    forward_copy = max(fetched / 2, activations) / rate
    backward_copy = max(fetched / 2 + activations, gradients) / rate
    exposed = max(0.0, forward_copy - forward) + max(0.0, backward_copy - backward)
    total = (fetched + 2 * activations + gradients) / rate
    ranks = min(machine.gpus_per_node, layout.dims.world_size)
    on_host = (
        shard * OPTIMIZER_BYTES_PER_PARAM / machine.host_step_bytes_per_second(ranks)
        if layout.offload_optimizer and layout.zero_stage >= 1
        else 0.0
    )
    micro_batches = layout.grad_accum
    return _HostCopies(
        total=micro_batches * total + update / rate,
        exposed=micro_batches * exposed + update / rate,
        optimizer_on_host=on_host,
    )


def predict(model: ModelSpec, layout: Layout, machine: Machine) -> StepTime:
    """Step time of `layout` on `machine`, term by term (see the module docstring)."""
    shape = _Shape.of(model, layout)
    micro_batches = layout.grad_accum
    micro = _micro_batch_time(model, layout, machine, shape)
    micro_seconds = micro.total
    syncs = _syncs_per_micro_batch(layout, shape)
    bubble, p2p = _pipeline_seconds(model, layout, machine, micro_seconds)

    group = layout.dims.dp * layout.dims.cp  # the DP x CP replicas
    params = params_per_rank(model, layout.dims.tp, layout.dims.pp, ep=layout.dims.ep)
    dp_seconds = _dp_seconds(layout, machine, params)
    hide = micro_seconds if layout.zero_stage < 3 else micro_batches * micro_seconds
    dp_exposed = max(0.0, dp_seconds - hide) if machine.overlap_dp else dp_seconds
    updated = params / group if layout.zero_stage >= 1 else params
    host = _host_copies(model, layout, machine, micro_seconds, params)
    optimizer_seconds = (
        host.optimizer_on_host
        if host.optimizer_on_host
        else updated * OPTIMIZER_BYTES_PER_PARAM / machine.memory_bytes_per_second
    )

    expert_terms = (
        {"ep_all_to_all": micro_batches * _ep_all_to_all_seconds(model, layout, machine, shape)}
        if model.moe is not None
        else {}
    )
    terms = {
        **expert_terms,
        "compute_matmul": micro_batches * micro.matmul,
        "compute_attention": micro_batches * micro.attention,
        "compute_elementwise": micro_batches * micro.elementwise,
        "compute_loss": micro_batches * micro.loss,
        "tp_collectives": micro_batches * micro.tp,
        "ulysses_all_to_all": micro_batches * micro.ulysses,
        "cp_ring_exposed": micro_batches * micro.ring,
        "cp_allgather": micro_batches * micro.allgather,
        "pp_bubble": bubble,
        "pp_p2p": p2p,
        "dp_collectives_exposed": dp_exposed,
        "optimizer": optimizer_seconds,
        "host_copies_exposed": host.exposed,
        "framework_overhead": micro_batches * machine.microbatch_overhead_seconds,
        "sync_overhead": (micro_batches * syncs + (1 if group > 1 else 0))
        * (machine.sync_seconds + machine.sync_jitter * (micro_seconds / max(syncs, 1)) ** 0.5),
    }
    step = sum(terms.values())
    tokens_per_second = layout.tokens_per_step / step / layout.dims.world_size
    achieved = {
        c: tokens_per_second * flops_per_token(model, layout.seq_len, c) for c in CONVENTIONS
    }
    reference = machine.peak_reference_flops or machine.peak_flops["bf16"]
    return StepTime(
        terms=terms,
        step_seconds=step,
        tokens_per_second_per_gpu=tokens_per_second,
        model_flops_per_second_per_gpu=achieved,
        mfu={c: achieved[c] / reference for c in CONVENTIONS},
        detail={
            "ring_hop_transfer_seconds": micro.ring_hop_transfer,
            "ring_hop_compute_seconds": micro.ring_hop_compute,
            "dp_collectives_seconds": dp_seconds,
            "microbatch_seconds": micro_seconds,
            "host_copy_seconds": host.total,
        },
        framework=machine.framework,
        expected_error=machine.expected_error,
        provenance=machine.provenance,
    )


def predict_spec(spec: JobSpec, machine: Machine | None = None, **changes: Any) -> StepTime:
    """`predict` for a validated spec (its layout with `changes`) on `machine` (default: the
    spec's GPU and fabric tables)."""
    return predict(
        spec.model,
        Layout.from_spec(spec).replace(**changes),
        machine or machine_for(spec, saved=False),
    )
