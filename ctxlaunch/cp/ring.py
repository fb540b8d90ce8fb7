# Shapes: q (B, Hq, S/N, D) and k, v (B, Hkv, S/N, D) are local shards; out (B, Hq, S/N, D); lse (B, Hq, S/N) fp32.
"""Ring attention: each rank keeps its queries while K/V shards travel around the ring.

Step t of N: rank i holds the K/V shard of rank (i - t) mod N. It posts the transfer of that
shard to rank i+1, computes attention of its queries over the shard in hand, merges the block
into its fp32 running output through the log-sum-exp, then waits for the next shard. Backward
rotates K/V the same way, and with them fp32 dK/dV accumulators that end at their owner; the
local block's backward is split around the loop so that the first and last transfers overlap
compute too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import kernels
from .comm import RingComm
from .layout import check_shard_len
from .merge import merge_block
from .reference import full_attention

_ALL = slice(None)


Part = tuple[slice, slice, bool]
"""(q_rows, kv_rows, causal) of one block piece."""


def _block(rank: int, src: int, causal: bool, layout: str, s_local: int) -> Part | None:
    """Which local query rows attend to which rows of ``src``'s K/V shard, and whether causally.

    Returns ``(q_rows, kv_rows, causal)`` or None when the mask hides the whole block. Zigzag
    shards are [chunk i, chunk 2N-1-i]: from an earlier rank only the first K/V half (its low
    chunk) is visible to all local queries; from a later rank only the local second half (the
    high chunk) sees anything, and it sees all of it. Every rank thus computes the same area.
    """
    if not causal:
        return _ALL, _ALL, False
    if src == rank:
        # Both shards hold the same chunks in the same order, so a top-left causal mask is exact.
        return _ALL, _ALL, True
    half = s_local // 2
    if layout == "zigzag":
        if src < rank:
            return _ALL, slice(0, half), False
        return slice(half, None), _ALL, False
    return (_ALL, _ALL, False) if src < rank else None


def _ring_forward(q, k, v, group, causal, layout, scale):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    comm = RingComm(group)
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(world_size):
        if step + 1 < world_size:
            next_k, next_v = comm.send_recv(k), comm.send_recv(v)
            comm.commit()
        block = _block(rank, (rank - step) % world_size, causal, layout, q.size(2))
        if block is not None:
            rows, kv_rows, block_causal = block
            block_out, block_lse = kernels.attention_forward(
                q[:, :, rows], k[:, :, kv_rows], v[:, :, kv_rows], block_causal, scale
            )
            if out is None:
                # Step 0 is the diagonal block, which covers every local query row.
                out, lse = block_out.to(torch.float32), block_lse
            else:
                assert lse is not None
                merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if step + 1 < world_size:
            comm.wait()
            k, v = next_k, next_v
    assert out is not None and lse is not None  # step 0's diagonal block always runs
    return out.to(q.dtype), lse


def _diagonal_parts(causal: bool, s_local: int) -> tuple[list[Part], list[Part]]:
    """The local (diagonal) block cut in two lists of ``(q_rows, kv_rows, causal)`` pieces.

    Backward runs the first list while the first K/V transfer flies and the second while the
    last dK/dV transfer flies, so no transfer is left waiting on an idle rank. Under a causal
    mask the cut is the local halves: the second half's rows see all of the first half's keys
    (it comes later in both layouts) and each half is causal on itself.
    """
    half = s_local // 2
    if half == 0:
        return [(_ALL, _ALL, causal)], []
    first, second = slice(0, half), slice(half, None)
    if not causal:
        return [(first, _ALL, False)], [(second, _ALL, False)]
    return [(second, first, False)], [(first, first, True), (second, second, True)]


def _ring_backward(grad_out, q, k, v, out, lse, group, causal, layout, scale):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    kv_comm, grad_comm = RingComm(group), RingComm(group)
    dq = torch.zeros_like(q, dtype=torch.float32)
    # Gradients of this rank's own K/V from its own queries stay here; the other ranks' shares
    # ride along with the K/V in an fp32 accumulator and come home after N-1 hops.
    dk_home = torch.zeros_like(k, dtype=torch.float32)
    dv_home = torch.zeros_like(v, dtype=torch.float32)

    def backward_block(rows: slice, kv_rows: slice, block_causal: bool, k_shard: torch.Tensor,
                       v_shard: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        block_dq, block_dk, block_dv = kernels.attention_backward(
            grad_out[:, :, rows], q[:, :, rows], k_shard[:, :, kv_rows], v_shard[:, :, kv_rows],
            out[:, :, rows], lse[:, :, rows], block_causal, scale,
        )
        dq[:, :, rows] += block_dq
        dk[:, :, kv_rows] += block_dk
        dv[:, :, kv_rows] += block_dv

    diagonal_first, diagonal_last = _diagonal_parts(causal, q.size(2))
    k_held, v_held = k, v  # the K/V shard in hand: rank (rank - step)'s
    # The dK/dV accumulators in flight: sent at each step, received by the next.
    next_dk: torch.Tensor | None = None
    next_dv: torch.Tensor | None = None
    for step in range(world_size):
        if step + 1 < world_size:
            next_k, next_v = kv_comm.send_recv(k_held), kv_comm.send_recv(v_held)
            kv_comm.commit()
        if step == 0:
            for part in diagonal_first:
                backward_block(*part, k, v, dk_home, dv_home)
        else:
            if step == 1:
                dk = torch.zeros_like(k, dtype=torch.float32)
                dv = torch.zeros_like(v, dtype=torch.float32)
            else:
                # The accumulators of the shard in hand, sent by rank-1 while we computed.
                grad_comm.wait()
                assert next_dk is not None and next_dv is not None
                dk, dv = next_dk, next_dv
            block = _block(rank, (rank - step) % world_size, causal, layout, q.size(2))
            if block is not None:
                backward_block(*block, k_held, v_held, dk, dv)
            next_dk, next_dv = grad_comm.send_recv(dk), grad_comm.send_recv(dv)
            grad_comm.commit()
        if step + 1 < world_size:
            kv_comm.wait()
            k_held, v_held = next_k, next_v
    for part in diagonal_last:
        backward_block(*part, k, v, dk_home, dv_home)
    # The other ranks' shares of our K/V gradient, home after N-1 hops.
    grad_comm.wait()
    if world_size > 1:
        assert next_dk is not None and next_dv is not None
        dk_home += next_dk
        dv_home += next_dv
    return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale):
        # gloo sends only contiguous buffers.
        k, v = k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, group, causal, layout, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        dq, dk, dv = _ring_backward(grad_out, *ctx.saved_tensors, *ctx.args)
        return dq, dk, dv, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
):
    """Ring attention over the ranks of ``group`` (None: the default group); differentiable.

    Each rank passes its shards of q (B, Hq, S/N, D) and k, v (B, Hkv, S/N, D), as
    ``shard_sequence(x, group, dim=2, layout=layout)`` cuts them from the full sequence, and gets
    its shard of the output (q's dtype). ``group`` is the whole CP group and ring order is rank
    order in it. GQA: Hq % Hkv == 0; K/V travel with their Hkv heads. ``scale`` defaults to
    1/sqrt(D). With ``return_lse`` also returns the fp32 log-sum-exp (B, Hq, S/N) of each row.
    """
    kernels.check_qkv(q, k, v)
    world_size = dist.get_world_size(group)
    check_shard_len(q.size(2), k.size(2), world_size, layout)
    scale = kernels.resolve_scale(q, scale)
    if world_size == 1:
        return full_attention(q, k, v, causal, scale, return_lse)
    out, lse = _RingAttention.apply(q, k, v, group, causal, layout, scale)
    return (out, lse) if return_lse else out
