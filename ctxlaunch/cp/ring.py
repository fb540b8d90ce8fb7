# Shapes: q (B, Hq, S/N, D) and k, v (B, Hkv, S/N, D) are local shards; out (B, Hq, S/N, D); lse (B, Hq, S/N) fp32.
"""Ring attention: each rank keeps its queries while K/V shards travel around the ring.

Step t of N: rank i holds the K/V shard of rank (i - t) mod N. It posts the transfer of that
shard to rank i+1, computes attention of its queries over the shard in hand, merges the block
into its fp32 running output through the log-sum-exp, then waits for the next shard. Backward
rotates K/V the same way, and with them fp32 dK/dV accumulators that end at their owner; the
local block's backward is split around the loop so that the first and last transfers overlap
compute too. Every transfer buffer, accumulator and merge scratch is allocated before the first
hop (two sets take turns receiving), so a hop allocates only what the kernels return; on CUDA
the transfers run on a side stream (``comm.side_stream``).

Under a document mask (``documents``: the global boundaries of a packed sequence's documents)
each block is the rectangles of ``documents.block_pieces``, computed on row and column slices
and merged the same way (the per-rectangle path), or, where ``kernels.masked_kernel()`` is
"flex", one FlexAttention call over the whole block with a block mask (``flex.py``); blocks
that share no document compute nothing (their K/V still pass through, since the ring's later
ranks need them). The shards may be cut by any CP sharding, the balanced one included: a
rank's shard is its runs of the sequence (``documents.RingShards``).

Under ``tile_tokens`` backward cuts every piece into tiles of at most that many query and key
rows (``_tiles``), so the kernels' gradient buffers are a tile's, not a shard's; a masked block
whose shard the tiles cut runs as its rectangles, each tiled, not as one FlexAttention call.

A local (sliding-window) layer does not rotate shards at all: its ranks exchange only the keys
some query of theirs sees (``window.py``'s halo exchange). Soft-capped scores (``softcap``) run
every block through the math kernel (no FlexAttention call); attention sinks (``sinks``) are
folded into each row once, after the last hop's merge, and their gradient is summed from the
final out and lse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import flex, kernels
from .comm import RingComm, side_stream
from .documents import CuSeqlens, RingShards, batch_groups, check_documents, ring_block_pieces
from .merge import MergeScratch, fold_sinks, merge_block, sink_gradient
from .reference import check_extensions, full_attention
from .sharding import check_shard_len
from .window import WindowArgs, effective_window, window_attention_on

_ALL = slice(None)


Part = tuple[slice, slice, bool]
"""(q_rows, kv_rows, causal) of one block piece."""

BatchPart = tuple[slice, slice, slice, bool]
"""(batch rows, q_rows, kv_rows, causal) of one block piece."""


def _block(rank: int, src: int, causal: bool, sharding: str, s_local: int) -> Part | None:
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
    if sharding != "contiguous":  # zigzag, and balanced without documents
        if src < rank:
            return _ALL, slice(0, half), False
        return slice(half, None), _ALL, False
    return (_ALL, _ALL, False) if src < rank else None


def _accumulator(q: torch.Tensor) -> torch.dtype:
    """The dtype of the running out and the dq/dk/dv sums: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(q.dtype, torch.float32)


def _pieces(
    rank: int,
    src: int,
    shards: RingShards,
    causal: bool,
    s_local: int,
    documents: CuSeqlens | None,
) -> list[BatchPart]:
    """The pieces of the block of ``src``'s K/V for this rank's queries. Unmasked: at most one
    (``_block``); under a document mask the rectangles of each batch group, diagonal first."""
    if documents is None:
        block = _block(rank, src, causal, shards.sharding, s_local)
        return [] if block is None else [(_ALL, *block)]
    return [
        (batch, *piece)
        for batch, bounds in batch_groups(documents)
        for piece in ring_block_pieces(bounds, shards, rank, src)
    ]


class _Rotation:
    """Two preallocated buffer sets that take turns receiving what the ring passes along.

    ``first`` is what the rank starts with. With ``keep_first`` (its own K/V, which backward
    still needs) it is sent and never written, and two spare sets take turns: each received set
    is sent on and, once that send is done, receives again two hops later. Without it (a dK/dV
    accumulator, overwritten by what arrives) ``first`` joins the turns after its send and one
    spare suffices. The spares are allocated here, before the first hop, so hops allocate nothing.
    """

    def __init__(self, first: tuple[torch.Tensor, ...], world_size: int, keep_first: bool):
        spares = min(world_size - 1, 2 if keep_first else 1)
        self._free = [tuple(torch.empty_like(t) for t in first) for _ in range(spares)]
        self._first = first if keep_first else None
        self.held = first

    def post(self, comm: RingComm) -> tuple[torch.Tensor, ...]:
        """Queue sending the held set and receiving into a free one; commit; return the latter."""
        incoming = self._free.pop()
        for send, recv in zip(self.held, incoming, strict=True):
            comm.send_recv(send, recv)
        comm.commit()
        self._incoming = incoming
        return incoming

    def advance(self) -> None:
        """After the wait: the received set is held; the one just sent is free again (unless it
        is a kept ``first``)."""
        if self.held is not self._first:
            self._free.insert(0, self.held)
        self.held = self._incoming


def _hop(direction: str, step: int):
    """A profiler range around one ring step (``cp.ring.forward.step3``): what traces show, and
    what the per-hop allocation test reads."""
    return torch.profiler.record_function(f"cp.ring.{direction}.step{step}")


def _ring_forward(q, k, v, group, causal, shards, scale, documents=None, softcap=None, sinks=None):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    comm = RingComm(group, side_stream(q.device))
    # The running fp32 out and lse, and the merge's scratch: allocated once, before the first hop.
    out = q.new_empty(q.shape, dtype=_accumulator(q))
    lse = q.new_empty(q.shape[:3], dtype=_accumulator(q))
    scratch = MergeScratch(out)
    kv = _Rotation((k, v), world_size, keep_first=True)
    one_call = (
        documents is not None and softcap is None and kernels.masked_kernel(q.device) == "flex"
    )
    for step in range(world_size):
        with _hop("forward", step):
            if step + 1 < world_size:
                kv.post(comm)
            k_held, v_held = kv.held
            src = (rank - step) % world_size
            pieces = _pieces(rank, src, shards, causal, q.size(2), documents)
            if one_call and pieces:
                # The whole block in one call; the diagonal block covers every row.
                assert documents is not None
                mask = flex.MASKS.get(documents, shards, rank, src, (0, q.size(2)), q.device)
                block_out, block_lse = flex.block_forward(q, k_held, v_held, mask, scale)
                if step == 0:
                    out.copy_(block_out)
                    lse.copy_(block_lse)
                else:
                    merge_block(out, lse, block_out, block_lse, scratch)
                pieces = []
            for batch, rows, kv_rows, block_causal in pieces:
                block_out, block_lse = kernels.attention_forward(
                    q[batch, :, rows],
                    k_held[batch, :, kv_rows],
                    v_held[batch, :, kv_rows],
                    block_causal,
                    scale,
                    softcap=softcap,
                )
                if step == 0 and block_causal == causal:
                    # Step 0's diagonal piece(s) cover every local query row exactly once.
                    out[batch, :, rows].copy_(block_out)
                    lse[batch, :, rows].copy_(block_lse)
                else:
                    merge_block(
                        out[batch, :, rows], lse[batch, :, rows], block_out, block_lse, scratch
                    )
            if step + 1 < world_size:
                comm.wait()
                kv.advance()
    if sinks is not None:
        fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def _diagonal_parts(causal: bool, s_local: int) -> tuple[list[Part], list[Part]]:
    """The local (diagonal) block cut in two lists of ``(q_rows, kv_rows, causal)`` pieces.

    Backward runs the first list while the first K/V transfer flies and the second while the
    last dK/dV transfer flies, so no transfer is left waiting on an idle rank. Under a causal
    mask the cut is the local halves: the second half's rows see all of the first half's keys
    (it comes later in both shardings) and each half is causal on itself.
    """
    half = s_local // 2
    if half == 0:
        return [(_ALL, _ALL, causal)], []
    first, second = slice(0, half), slice(half, None)
    if not causal:
        return [(first, _ALL, False)], [(second, _ALL, False)]
    return [(second, first, False)], [(first, first, True), (second, second, True)]


def _split_diagonal(pieces: list[BatchPart]) -> tuple[list[BatchPart], list[BatchPart]]:
    """A masked diagonal block's rectangles in two lists, as ``_diagonal_parts`` cuts the
    unmasked one: the full (off-diagonal) rectangles first, else half of the causal ones."""
    full = [p for p in pieces if not p[3]]
    causal = [p for p in pieces if p[3]]
    if full:
        return full, causal
    return causal[: len(causal) // 2], causal[len(causal) // 2 :]


def _span(rows: slice, length: int) -> tuple[int, int]:
    start, stop, _ = rows.indices(length)
    return start, stop


def _cuts(start: int, stop: int, tile: int) -> list[tuple[int, int]]:
    return [(first, min(first + tile, stop)) for first in range(start, stop, tile)]


def _tiles(part: Part, q_len: int, kv_len: int, tile: int | None) -> list[Part]:
    """A piece cut into tiles of at most ``tile`` query rows and ``tile`` key rows. A causal
    piece is a square aligned top-left: its tiles share one grid, those below the diagonal
    are whole, those on it causal and those above it hidden. ``tile`` None: the piece itself."""
    rows, kv_rows, causal = part
    if tile is None:
        return [part]
    q_span, kv_span = _span(rows, q_len), _span(kv_rows, kv_len)
    if q_span[1] - q_span[0] <= tile and kv_span[1] - kv_span[0] <= tile:
        return [part]
    if causal and q_span[1] - q_span[0] != kv_span[1] - kv_span[0]:
        raise ValueError(f"a causal piece must be square, got rows {q_span} and keys {kv_span}")
    q_cuts, kv_cuts = _cuts(*q_span, tile), _cuts(*kv_span, tile)
    return [
        (slice(*q_cut), slice(*kv_cut), causal and i == j)
        for i, q_cut in enumerate(q_cuts)
        for j, kv_cut in enumerate(kv_cuts)
        if not causal or j <= i
    ]


def _ring_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    group,
    causal,
    shards,
    scale,
    documents=None,
    tile=None,
    softcap=None,
    sinks=None,
):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    stream = side_stream(q.device)
    kv_comm, grad_comm = RingComm(group, stream), RingComm(group, stream)
    acc = _accumulator(q)
    dq = torch.zeros_like(q, dtype=acc)
    # Gradients of this rank's own K/V from its own queries stay here; the other ranks' shares
    # ride along with the K/V in an fp32 (fp64 for fp64) accumulator and come home after N-1 hops.
    dk_home = torch.zeros_like(k, dtype=acc)
    dv_home = torch.zeros_like(v, dtype=acc)

    def backward_block(
        batch: slice,
        rows: slice,
        kv_rows: slice,
        block_causal: bool,
        k_shard: torch.Tensor,
        v_shard: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
    ) -> None:
        for q_tile, kv_tile, tile_causal in _tiles(
            (rows, kv_rows, block_causal), q.size(2), k_shard.size(2), tile
        ):
            block_dq, block_dk, block_dv = kernels.attention_backward(
                grad_out[batch, :, q_tile],
                q[batch, :, q_tile],
                k_shard[batch, :, kv_tile],
                v_shard[batch, :, kv_tile],
                out[batch, :, q_tile],
                lse[batch, :, q_tile],
                tile_causal,
                scale,
                softcap=softcap,
            )
            # In place, the kernel's dtype converted on the fly (CUDA casts inside the add
            # kernel).
            dq[batch, :, q_tile] += block_dq
            dk[batch, :, kv_tile] += block_dk
            dv[batch, :, kv_tile] += block_dv

    # Where tiles cut the shard, a masked block runs as its rectangles, each tiled (a block
    # mask covers the whole of a block's keys).
    cut = tile is not None and tile < q.size(2)
    one_call = (
        documents is not None
        and not cut
        and softcap is None
        and kernels.masked_kernel(q.device) == "flex"
    )

    def one_call_block(rows: tuple[int, int], src, k_shard, v_shard, dk, dv) -> None:
        """A block's gradients in one FlexAttention call (its query rows ``rows``)."""
        assert documents is not None
        mask = flex.MASKS.get(documents, shards, rank, src, rows, q.device)
        r = slice(*rows)
        block_dq, block_dk, block_dv = flex.block_backward(
            grad_out[:, :, r], q[:, :, r], k_shard, v_shard, out[:, :, r], lse[:, :, r], mask, scale
        )
        dq[:, :, r] += block_dq
        dk += block_dk
        dv += block_dv

    # One call per block: the own block in two calls, by query rows, so that the first K/V
    # transfer and the last dK/dV transfer overlap compute as in the per-rectangle path.
    half = q.size(2) // 2
    own_first = [(0, half)] if one_call and half else []
    own_last = [(half, q.size(2))] if one_call else []
    diagonal_first: list[BatchPart] = []
    diagonal_last: list[BatchPart] = []
    if documents is None:
        first, last = _diagonal_parts(causal, q.size(2))
        diagonal_first = [(_ALL, *part) for part in first]
        diagonal_last = [(_ALL, *part) for part in last]
    elif not one_call:
        diagonal_first, diagonal_last = _split_diagonal(
            _pieces(rank, rank, shards, causal, q.size(2), documents)
        )
    kv = _Rotation((k, v), world_size, keep_first=True)
    # The dK/dV accumulators in flight: this rank's first travelling pair is filled at step 1;
    # from step 2 on each pair in hand is what rank-1 sent while we computed.
    grads = _Rotation(
        (torch.zeros_like(dk_home), torch.zeros_like(dv_home)), world_size, keep_first=False
    )
    for step in range(world_size):
        with _hop("backward", step):
            if step + 1 < world_size:
                kv.post(kv_comm)
            k_held, v_held = kv.held
            if step == 0:
                for rows in own_first:
                    one_call_block(rows, rank, k, v, dk_home, dv_home)
                for part in diagonal_first:
                    backward_block(*part, k, v, dk_home, dv_home)
            else:
                if step > 1:
                    grad_comm.wait()
                    grads.advance()
                dk, dv = grads.held
                src = (rank - step) % world_size
                pieces = _pieces(rank, src, shards, causal, q.size(2), documents)
                if one_call and pieces:
                    one_call_block((0, q.size(2)), src, k_held, v_held, dk, dv)
                    pieces = []
                for piece in pieces:
                    backward_block(*piece, k_held, v_held, dk, dv)
                grads.post(grad_comm)
            if step + 1 < world_size:
                kv_comm.wait()
                kv.advance()
    for rows in own_last:
        one_call_block(rows, rank, k, v, dk_home, dv_home)
    for part in diagonal_last:
        backward_block(*part, k, v, dk_home, dv_home)
    # The other ranks' shares of our K/V gradient, home after N-1 hops.
    if world_size > 1:
        grad_comm.wait()
        grads.advance()
        dk_home += grads.held[0]
        dv_home += grads.held[1]
    d_sinks = None if sinks is None else sink_gradient(grad_out, out, lse, sinks)
    return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype), d_sinks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, causal, shards, scale, documents, tile, softcap):
        # gloo sends only contiguous buffers.
        k, v = k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, group, causal, shards, scale, documents, softcap, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, causal, shards, scale, documents, tile, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, causal, shards, scale, documents, tile, softcap = ctx.args
        dq, dk, dv, d_sinks = _ring_backward(
            grad_out, q, k, v, out, lse, group, causal, shards, scale, documents, tile,
            softcap, sinks,
        )  # fmt: skip
        return dq, dk, dv, d_sinks, None, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    sharding: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
    documents: Sequence[Sequence[int]] | None = None,
    tile_tokens: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Ring attention over the ranks of ``group`` (None: the default group); differentiable.

    Each rank passes its shards of q (B, Hq, S/N, D) and k, v (B, Hkv, S/N, D), as
    ``shard_sequence(x, group, dim=2, sharding=sharding)`` cuts them from the full sequence, and gets
    its shard of the output (q's dtype). ``group`` is the whole CP group and ring order is rank
    order in it. GQA: Hq % Hkv == 0; K/V travel with their Hkv heads. ``scale`` defaults to
    1/sqrt(D). With ``return_lse`` also returns the fp32 log-sum-exp (B, Hq, S/N) of each row.

    ``documents``: a document mask for packed sequences, one list per batch element of the
    global document boundaries ``[0, end of doc 0, ..., S]`` (cumulative sequence lengths of
    the whole sequence, S = N * S/N); queries then attend causally within their document only,
    and blocks that share no document are skipped (see ``documents.py``). Needs ``causal``.
    Under ``sharding="balanced"`` the shards must have been cut with the same ``documents``
    (``shard_sequence(..., documents=documents)``).

    ``tile_tokens``: backward computes each block over tiles of at most this many query rows
    and key rows, so what the kernels allocate (their dq, dk, dv and accumulators) is bounded
    by the tile, not by the shard; the same sums in another order. None: one call per block.

    ``window``: a local layer's sliding window (a query at i sees keys i - window < j <= i):
    the ranks exchange only the keys some query of theirs sees (``window.py``). ``softcap``:
    scores become ``softcap * tanh(score / softcap)`` in every block. ``sinks`` (Hq,): a
    learned logit per head in every row's softmax denominator, counted once (differentiable).
    All three need ``causal``.
    """
    kernels.check_qkv(q, k, v)
    world_size = dist.get_world_size(group)
    check_shard_len(q.size(2), k.size(2), world_size, sharding)
    scale = kernels.resolve_scale(q, scale)
    check_tile_tokens(tile_tokens)
    if world_size == 1:
        return full_attention(
            q, k, v, causal, scale, return_lse, documents, window=window, softcap=softcap,
            sinks=sinks,
        )  # fmt: skip
    check_extensions(causal, window, softcap, sinks, q.size(1))
    cu = check_documents(documents, causal, q.size(0), q.size(2) * world_size)
    return ring_attention_on(
        q, k, v, group, causal, RingShards(sharding, world_size), scale, return_lse, cu,
        tile_tokens, window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip


def check_tile_tokens(tile_tokens: int | None) -> None:
    """Raise ValueError unless ``tile_tokens`` is None or a positive integer."""
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or tile_tokens < 1):
        raise ValueError(f"tile_tokens must be None or a positive integer, got {tile_tokens!r}")


def ring_attention_on(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    causal: bool,
    shards: RingShards,
    scale: float,
    return_lse: bool,
    documents: CuSeqlens | None,
    tile_tokens: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """``ring_attention`` on checked inputs, over shards cut as ``shards`` says (a hybrid's
    inner ring holds its Ulysses groups' tokens). A window shorter than the sequence runs
    the halo exchange instead of the ring."""
    window = effective_window(window, q.size(2) * shards.ring_size)
    if window is not None:
        args = WindowArgs(group, shards, documents, window, scale, softcap)
        return window_attention_on(q, k, v, args, sinks, return_lse)
    out, lse = _RingAttention.apply(
        q, k, v, sinks, group, causal, shards, scale, documents, tile_tokens, softcap
    )
    return (out, lse) if return_lse else out
