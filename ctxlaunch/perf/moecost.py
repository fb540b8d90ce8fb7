"""What a mixture-of-experts feed-forward costs (model.moe): the parameters a rank holds and
their states, what it saves for backward, the dispatch and combine buffers at the worst routing
the planner admits, and the all-to-all's volume. Pure arithmetic over the layout; the memory,
step-time and communication models add these to a dense block's terms. The constants are
derived from the layer the trainer builds (runtime/modeling/moe.py, parallel/expert_parallel.py)
and checked against memory measured on the CPU (tests/unit/test_moe_memory.py).

Per rank, T tokens (its sequence-parallel share of the micro-batch), k experts per token, E
experts of width f_e (E / ep on the rank), a the compute dtype's bytes, h the hidden width:

    saved for backward, by the tokens' side, per token           bytes
      the normed input, in the compute dtype (router, rows, shared) a*h
      router probabilities (fp32), top-k indices, renormalisation  4*E + 8*k (+ 4*k + 4)
      the gather and un-permute indices                           2 * 8*k
      the experts' outputs back in token order, and their weights k*(a*h + a)
    saved by the experts, per routing they receive
      the rows, gate and up, the SwiGLU output                     a*(h + 3*f_e)
      under expert parallelism the regroup and restore indices     2 * 8
    a shared expert (width f_s), per token: gate and up, SwiGLU output, its output and its
      sigmoid gate                                                a*(3*f_s + h) + 2*a

The routings a rank's experts receive are k*T times the routing load the planner admits
(`routed_load`): under expert parallelism the busiest rank of an EP group can receive more than
its share. Dropless, every routing of the group may go to one rank's experts, so the planner
admits `moe.planned_load` (the busiest rank's routings over the mean; default: ep, that worst
case); with a capacity factor c at most c times the mean reach an expert. Telemetry measures the
load a run sees (`expert_rank_load`).

All-to-all per mixture-of-experts layer and micro-batch, forward: each rank sends its k*T rows
of a*h bytes less the (1/ep) that stay, and gets as many back; backward moves the same again.
An EP group spanning nodes sends the share bound for other nodes over the fabric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxlaunch.perf.layout import Layout

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec

INDEX_BYTES = 8
"""int64: the routings' expert ids, and the gather and un-permute indices."""


def routed_load(model: ModelSpec, layout: Layout) -> float:
    """The routings the busiest expert rank receives over its share (1 without expert
    parallelism): `moe.planned_load` if set, else the capacity's bound, else ep (every routing
    of the EP group to one rank)."""
    moe = model.moe
    ep = layout.dims.ep
    if moe is None or ep == 1:
        return 1.0
    if moe.planned_load is not None:
        return min(float(moe.planned_load), ep)
    if moe.capacity_factor is not None:
        return min(moe.capacity_factor, ep)
    return float(ep)


def source_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """What a mixture-of-experts feed-forward saves on its tokens' side, per token (the
    module docstring's table, the shared expert included)."""
    moe = model.moe
    if moe is None:
        return 0.0
    a, h, k, e = layout.compute_bytes, model.hidden, moe.experts_per_token, moe.experts
    saved = a * h + 4 * e + INDEX_BYTES * k + 2 * INDEX_BYTES * k + k * (a * h + a)
    if moe.norm_topk_prob:
        saved += 4 * k + 4
    if model.shared_expert and moe.shared_ffn_hidden:
        saved += a * (3 * moe.shared_ffn_hidden + h) + 2 * a
    return saved


def expert_bytes_per_routing(model: ModelSpec, layout: Layout) -> float:
    """What the experts save per routing they receive."""
    moe = model.moe
    if moe is None:
        return 0.0
    saved = layout.compute_bytes * (model.hidden + 3 * moe.ffn_hidden)
    if layout.dims.ep > 1:
        saved += 2 * INDEX_BYTES
    return saved


def feed_forward_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """What a mixture-of-experts feed-forward (the norm before it excluded) saves per token of
    the rank, at the routing load the planner admits."""
    moe = model.moe
    if moe is None:
        return 0.0
    routed = moe.experts_per_token * routed_load(model, layout)
    return source_bytes_per_token(model, layout) + routed * expert_bytes_per_routing(model, layout)


def expert_params(model: ModelSpec) -> int:
    """One mixture-of-experts block's routed experts' parameters (all E)."""
    moe = model.moe
    if moe is None:
        return 0
    biases = 2 * moe.ffn_hidden + model.hidden if model.expert_biases else 0
    return moe.experts * (3 * model.hidden * moe.ffn_hidden + biases)


def weight_copy_bytes(model: ModelSpec, layout: Layout) -> float:
    """Under autocast with fp32 weights, the 16-bit copies a mixture-of-experts block's
    matmuls keep for backward: the rank's experts, the router and the shared expert with its
    gate (whole on every TP rank)."""
    moe = model.moe
    if moe is None:
        return 0.0
    h = model.hidden
    weights = expert_params(model) / layout.dims.ep + moe.experts * h
    if model.shared_expert and moe.shared_ffn_hidden:
        weights += 3 * h * moe.shared_ffn_hidden + h
    return 2.0 * weights


def dispatch_buffer_bytes(model: ModelSpec, layout: Layout) -> float:
    """The dispatch's transients at its peak in forward (under expert parallelism): the rows
    gathered to send, the rows received and the received rows regrouped by expert, at the
    admitted routing load; the combine's in backward are as many."""
    moe = model.moe
    if moe is None or layout.dims.ep == 1:
        return 0.0
    tokens = layout.tokens_per_rank / layout.dims.tp
    rows = moe.experts_per_token * tokens * layout.compute_bytes * model.hidden
    return rows * (1 + 2 * routed_load(model, layout))


def all_to_all_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes one rank sends by all-to-all per mixture-of-experts layer and micro-batch, forward
    and backward (dispatch and combine each way), the rows that stay on the rank left out."""
    moe = model.moe
    if moe is None or layout.dims.ep == 1:
        return 0.0
    tokens = layout.tokens_per_rank / layout.dims.tp
    rows = moe.experts_per_token * tokens * layout.compute_bytes * model.hidden
    return 4 * rows * (1 - 1 / layout.dims.ep)


def all_to_all_split(layout: Layout, gpus_per_node: int) -> tuple[float, float]:
    """The shares of the all-to-all's bytes that stay inside a node and cross the fabric: an
    EP group is ep ranks tp apart in the rank order (the shard group's consecutive ranks of one
    TP index), so it spans ceil(ep * tp / gpus_per_node) nodes; a rank sends to each peer
    alike."""
    ep = layout.dims.ep
    if ep == 1:
        return 1.0, 0.0
    span = ep * layout.dims.tp
    peers_in_node = max(min(gpus_per_node, span) // layout.dims.tp, 1)
    inside = (peers_in_node - 1) / (ep - 1)
    return inside, 1.0 - inside
