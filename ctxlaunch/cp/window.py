# Shapes: q (B, Hq, S/N, D), k, v (B, Hkv, S/N, D) local shards; halo (2, B, Hkv, rows, D); lse (B, Hq, S/N) fp32.
"""Local (sliding-window) attention, at one process or under context parallelism, and the
attention every layout runs through the same pieces when scores are soft-capped or heads have
sinks.

A local layer's query at global position i sees the keys j with i - window < j <= i (the window
counts the query itself, as transformers' sliding-window mask does) and, under a document mask,
only those of its own document. A rank's shard is its runs of the sequence
(``documents.RingShards``: zigzag, contiguous, balanced, or a hybrid's Ulysses groups).

**The halo exchange.** From another rank (a peer) a local layer needs only the peer's keys some
local query sees: at most window - 1 positions before each of its runs. So instead of rotating
whole shards N - 1 hops, every rank sends each peer exactly the rows that peer's queries see,
K and V packed in one buffer, all in one point-to-point exchange (``comm.PeerComm``): one send
per chunk whose window reaches into another rank's chunk (one per chunk when the window fits in
the preceding chunk; more only when it spans several). A pair of ranks whose blocks hold no
visible (query, key) pair exchanges nothing and computes nothing. While the halos fly each rank
computes its own block; then each halo's block. Backward keeps the received halos (no second
exchange of K and V; they are the window's size per chunk, not a shard's) and sends the halos'
fp32 dK/dV back to their owners in one more exchange, overlapped with the own block's backward.
Every rank computes the plan of every pair it takes part in from the sharding alone (cached),
so both sides of a transfer agree on its rows without a word.

**Pieces and calls.** The visible area of a block is one piece per (query run, key run,
document), tightened to the rows that see a key and the keys some row sees, with its offset
(first query position minus first key position). A piece whose window never binds is one
kernel call, full or causal (square, on the diagonal). Otherwise its rows are cut into tiles of
at most ``BAND_TILE_TOKENS`` (and the window) and each tile's keys into three calls: the
window's lower edge (a triangle: the one masked call, through an additive mask of the tile's
size), the keys every row of the tile sees (full), and the tile's diagonal square (causal). No
call covers a pair outside the window but the hidden half of the edge triangle.

Where ``kernels.masked_kernel()`` is "flex" (on CUDA by default), each block (the own one,
each halo's) is one FlexAttention call instead, with a block mask of its rows' and keys' global
positions, documents and the window (``flex.py``; built once per step and layer kind, kept for
the other layers and backward). Soft-capped scores (``softcap``) run every call through the
math kernel (``kernels``; FlexAttention's backward here takes no score modifier); sinks
(``sinks``, one logit per query head) are folded into each row's log-sum-exp once, after every
piece is merged (``merge.fold_sinks``), and their gradient is summed from the final out and lse.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import flex, kernels
from .comm import PeerComm, side_stream
from .documents import CuSeqlens, RingShards, Run, batch_groups, documents_in
from .merge import MergeScratch, fold_sinks, merge_block, sink_gradient

BAND_TILE_TOKENS = 256
"""Query rows per tile of a piece the window cuts: the masked edge triangle is at most this
square, so about a quarter of a tile's computed area under a 1,024-token window is hidden."""

Piece = tuple[slice, slice, int]
"""(q_rows, kv_rows, offset): local rows of the queries and of the keys; a pair (a, b) of the
piece is visible iff 0 <= offset + a - b < window (counted from the piece's first row and
key)."""

Call = tuple[slice, slice, str, int]
"""(q_rows, kv_rows, kind, offset) of one kernel call: kind "full" (every pair visible),
"causal" (a square on the diagonal) or "band" (an additive mask of the call's size)."""


def check_window(window: int | None) -> None:
    """Raise ValueError unless ``window`` is None or a positive integer."""
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be None or a positive integer, got {window!r}")


def check_softcap(softcap: float | None) -> None:
    """Raise ValueError unless ``softcap`` is None or a positive finite number."""
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive number, got {softcap!r}")


def check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    """Raise ValueError unless ``sinks`` is None or one logit per query head."""
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must hold one logit per query head ({heads},), got {tuple(sinks.shape)}"
        )


def effective_window(window: int | None, seq_len: int) -> int | None:
    """The window, or None where it hides nothing (at least the whole sequence)."""
    return None if window is None or window >= seq_len else int(window)


# -- the plan: which pairs are visible, and the calls that compute them --------------------------
def _visible(i_lo: int, i_hi: int, j_lo: int, j_hi: int, window: int | None):
    """Rows [i_lo, i_hi) and keys [j_lo, j_hi), in coordinates where (i, j) is visible iff
    0 <= i - j < window, tightened to the rows that see a key and the keys some row sees."""
    lo = max(i_lo, j_lo)
    hi = i_hi if window is None else min(i_hi, j_hi - 1 + window)
    if lo >= hi:
        return None
    k_lo = j_lo if window is None else max(j_lo, lo - window + 1)
    k_hi = min(j_hi, hi)
    return (lo, hi, k_lo, k_hi) if k_lo < k_hi else None


def run_pieces(
    bounds: tuple[int, ...], q_runs: Sequence[Run], kv_runs: Sequence[Run], window: int | None
) -> list[Piece]:
    """The pieces of a block: queries of ``q_runs`` over keys of ``kv_runs`` (runs as
    ``RingShards.runs`` gives them), under the document mask of ``bounds`` and ``window``."""
    pieces: list[Piece] = []
    for lq, gq, nq in q_runs:
        for lk, gk, nk in kv_runs:
            if gk >= gq + nq or (window is not None and gq - (gk + nk - 1) >= window):
                continue  # every key after every query, or out of every query's window
            for doc in documents_in(bounds, max(gq, gk), gq + nq):
                d0, d1 = bounds[doc], bounds[doc + 1]
                span = _visible(
                    max(gq, d0), min(gq + nq, d1), max(gk, d0), min(gk + nk, d1), window
                )
                if span is not None:
                    i_lo, i_hi, j_lo, j_hi = span
                    pieces.append(
                        (
                            slice(lq + i_lo - gq, lq + i_hi - gq),
                            slice(lk + j_lo - gk, lk + j_hi - gk),
                            i_lo - j_lo,
                        )
                    )
    return pieces


def _call(
    rows: slice, kv_rows: slice, a: tuple[int, int], b: tuple[int, int], offset: int, window
) -> Call:
    """The call over piece-local rows a and keys b of a piece at ``rows``/``kv_rows``."""
    n, m = a[1] - a[0], b[1] - b[0]
    sub_offset = offset + a[0] - b[0]
    q_rows = slice(rows.start + a[0], rows.start + a[1])
    k_rows = slice(kv_rows.start + b[0], kv_rows.start + b[1])
    if sub_offset - (m - 1) >= 0 and (window is None or sub_offset + n - 1 < window):
        return q_rows, k_rows, "full", sub_offset
    if sub_offset == 0 and n == m and (window is None or n <= window):
        return q_rows, k_rows, "causal", 0
    return q_rows, k_rows, "band", sub_offset


def piece_calls(piece: Piece, window: int | None, tile: int = BAND_TILE_TOKENS) -> list[Call]:
    """The kernel calls of one piece (see the module docstring)."""
    rows, kv_rows, offset = piece
    n, m = rows.stop - rows.start, kv_rows.stop - kv_rows.start
    if window is None or offset + n - 1 < window:
        return [_call(rows, kv_rows, (0, n), (0, m), offset, None)]
    calls = []
    step = min(window, tile)
    for a0 in range(0, n, step):
        a1 = min(a0 + step, n)
        # The tile's keys: the window's lower edge, those every row sees, the diagonal square.
        for b0, b1 in (
            (a0 + offset - window + 1, a1 + offset - window),
            (a1 + offset - window, a0 + offset),
            (a0 + offset, a1 + offset),
        ):
            span = _visible(a0 + offset, a1 + offset, max(b0, 0), min(b1, m), window)
            if span is not None:
                i_lo, i_hi, j_lo, j_hi = span
                calls.append(
                    _call(
                        rows, kv_rows, (i_lo - offset, i_hi - offset), (j_lo, j_hi), offset, window
                    )
                )
    return calls


def _spans(rows: set[int]) -> tuple[tuple[int, int], ...]:
    """Sorted row indices as maximal [start, stop) intervals."""
    spans: list[tuple[int, int]] = []
    for row in sorted(rows):
        if spans and spans[-1][1] == row:
            spans[-1] = (spans[-1][0], row + 1)
        else:
            spans.append((row, row + 1))
    return tuple(spans)


@dataclass(frozen=True)
class BlockPlan:
    """One block (this rank's queries over one rank's keys): its calls per batch group, and for
    a peer's block the rows of the peer's shard they read (the halo), which the calls' key
    slices index in that order."""

    calls: tuple[tuple[slice, tuple[Call, ...]], ...]
    """(batch rows, calls) per group of batch elements with the same documents."""
    halo: tuple[tuple[int, int], ...]
    """The source shard's rows the calls read, as [start, stop) intervals (empty: none; for
    the own block, the calls index the shard itself)."""

    @property
    def halo_rows(self) -> int:
        return sum(stop - start for start, stop in self.halo)


def _runs(shards: RingShards | None, bounds: tuple[int, ...], rank: int) -> tuple[Run, ...]:
    if shards is None:  # one process: the whole sequence, in order
        return ((0, 0, bounds[-1]),)
    return shards.runs(bounds, rank)


@functools.lru_cache(maxsize=4096)
def block_plan(
    documents: CuSeqlens | None,
    seq_len: int,
    shards: RingShards | None,
    rank: int,
    src: int,
    window: int | None,
    tile: int = BAND_TILE_TOKENS,
) -> BlockPlan:
    """The plan of ring rank ``rank``'s queries over ring rank ``src``'s keys (``shards`` None:
    one process). Cached: every local layer of a step, forward and backward, asks again."""
    groups = batch_groups(documents) if documents is not None else [(slice(None), (0, seq_len))]
    pieces = [
        (batch, run_pieces(bounds, _runs(shards, bounds, rank), _runs(shards, bounds, src), window))
        for batch, bounds in groups
    ]
    if src == rank:
        return BlockPlan(
            tuple(
                (batch, tuple(c for p in ps for c in piece_calls(p, window, tile)))
                for batch, ps in pieces
            ),
            (),
        )
    needed: set[int] = set()
    for _, ps in pieces:
        for _, kv_rows, _ in ps:
            needed.update(range(kv_rows.start, kv_rows.stop))
    halo = _spans(needed)
    starts = [start for start, _ in halo]
    position, total = [], 0
    for start, stop in halo:
        position.append(total)
        total += stop - start

    def in_halo(kv_rows: slice) -> slice:
        at = bisect.bisect_right(starts, kv_rows.start) - 1
        first = position[at] + kv_rows.start - halo[at][0]
        return slice(first, first + kv_rows.stop - kv_rows.start)

    calls = tuple(
        (
            batch,
            tuple(
                (q_rows, in_halo(kv_rows), kind, offset)
                for piece in ps
                for q_rows, kv_rows, kind, offset in piece_calls(piece, window, tile)
            ),
        )
        for batch, ps in pieces
    )
    return BlockPlan(calls, halo)


@functools.lru_cache(maxsize=64)
def _band_mask(
    n: int, m: int, offset: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive mask of a band call: 0 where 0 <= offset + a - b < window, -inf elsewhere."""
    d = offset + torch.arange(n, device=device)[:, None] - torch.arange(m, device=device)[None, :]
    visible = d >= 0
    if window is not None:
        visible &= d < window
    return torch.zeros((n, m), dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def _mask(call: Call, window: int | None, q: torch.Tensor) -> torch.Tensor | None:
    rows, kv_rows, kind, offset = call
    if kind != "band":
        return None
    return _band_mask(
        rows.stop - rows.start, kv_rows.stop - kv_rows.start, offset, window, q.dtype, q.device
    )


# -- forward and backward -----------------------------------------------------------------------
@dataclass(frozen=True)
class WindowArgs:
    """What a local layer's call is, besides its tensors."""

    group: dist.ProcessGroup | None
    """The ring's group (None: one process)."""
    shards: RingShards | None
    """How the ring's shards are cut (None: one process)."""
    documents: CuSeqlens | None
    """The document mask's global boundaries per batch element (None: none)."""
    window: int | None
    """The local layer's window (None: the whole causal prefix, as a full layer)."""
    scale: float
    """What scores are multiplied by."""
    softcap: float | None
    """Scores soft-capped, softcap * tanh(score / softcap) (None: not)."""
    tile: int = BAND_TILE_TOKENS
    """Query rows per tile of a piece the window cuts."""

    def place(self) -> tuple[int, int]:
        """(this rank, ranks) in the ring."""
        if self.group is None and self.shards is None:
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def plan(self, seq_len: int, rank: int, src: int) -> BlockPlan:
        """The (cached) plan of ``rank``'s queries over ``src``'s keys."""
        return block_plan(self.documents, seq_len, self.shards, rank, src, self.window, self.tile)

    def one_call(self, device: torch.device) -> bool:
        """Each block in one FlexAttention call (masked blocks on CUDA, unless told
        otherwise; never with soft-capped scores)."""
        masked = self.window is not None or self.documents is not None
        return masked and self.softcap is None and kernels.masked_kernel(device) == "flex"

    def block_mask(self, seq_len: int, rank: int, src: int, q: torch.Tensor):
        """The FlexAttention block mask of ``rank``'s queries ``q`` over ``src``'s keys (its
        halo's rows for another rank), kept for the step's other layers of this kind."""
        batch = q.size(0)
        key = (self.documents, batch, seq_len, self.shards, rank, src, self.window, str(q.device))
        mask = _FLEX_MASKS.get(key)
        if mask is None:
            mask = _build_mask(self, batch, seq_len, rank, src, q.device)
            _FLEX_MASKS[key] = mask
            while len(_FLEX_MASKS) > _FLEX_CAPACITY:
                _FLEX_MASKS.pop(next(iter(_FLEX_MASKS)))
        return mask


_FLEX_MASKS: dict[tuple, object] = {}
_FLEX_CAPACITY = 256


def _build_mask(
    args: WindowArgs, batch: int, seq_len: int, rank: int, src: int, device: torch.device
):
    plan = args.plan(seq_len, rank, src)
    q_pos, q_doc, kv_pos, kv_doc = [], [], [], []
    for bounds in args.documents or ((0, seq_len),) * batch:
        mine = [g + i for _, g, n in _runs(args.shards, bounds, rank) for i in range(n)]
        theirs = [g + i for _, g, n in _runs(args.shards, bounds, src) for i in range(n)]
        if src != rank:
            theirs = [theirs[row] for start, stop in plan.halo for row in range(start, stop)]
        q_pos.append(mine)
        kv_pos.append(theirs)
        q_doc.append([bisect.bisect_right(bounds, p) - 1 for p in mine])
        kv_doc.append([bisect.bisect_right(bounds, p) - 1 for p in theirs])

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return flex.document_block_mask(
        as_tensor(q_pos), as_tensor(q_doc), as_tensor(kv_pos), as_tensor(kv_doc), args.window
    )


def _pack(k: torch.Tensor, v: torch.Tensor, halo: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """K and V rows of ``halo`` in one contiguous (2, B, Hkv, rows, D) buffer."""
    rows = sum(stop - start for start, stop in halo)
    buffer = k.new_empty((2, k.size(0), k.size(1), rows, k.size(3)))
    at = 0
    for start, stop in halo:
        buffer[0, :, :, at : at + stop - start].copy_(k[:, :, start:stop])
        buffer[1, :, :, at : at + stop - start].copy_(v[:, :, start:stop])
        at += stop - start
    return buffer


def _forward_calls(q, k, v, plan: BlockPlan, out, lse, scratch, args: WindowArgs, mask=None):
    if mask is not None:  # the whole block in one call
        block_out, block_lse = flex.block_forward(q, k, v, mask, args.scale)
        merge_block(out, lse, block_out, block_lse, scratch)
        return
    for batch, calls in plan.calls:
        for call in calls:
            rows, kv_rows, kind, _ = call
            block_out, block_lse = kernels.attention_forward(
                q[batch, :, rows],
                k[batch, :, kv_rows],
                v[batch, :, kv_rows],
                kind == "causal",
                args.scale,
                softcap=args.softcap,
                mask=_mask(call, args.window, q),
            )
            merge_block(out[batch, :, rows], lse[batch, :, rows], block_out, block_lse, scratch)


def _backward_calls(grad_out, q, k, v, out, lse, plan, dq, dk, dv, args: WindowArgs, mask=None):
    if mask is not None:  # the whole block in one call
        block_dq, block_dk, block_dv = flex.block_backward(
            grad_out, q, k, v, out, lse, mask, args.scale
        )
        dq += block_dq
        dk += block_dk
        dv += block_dv
        return
    for batch, calls in plan.calls:
        for call in calls:
            rows, kv_rows, kind, _ = call
            block_dq, block_dk, block_dv = kernels.attention_backward(
                grad_out[batch, :, rows],
                q[batch, :, rows],
                k[batch, :, kv_rows],
                v[batch, :, kv_rows],
                out[batch, :, rows],
                lse[batch, :, rows],
                kind == "causal",
                args.scale,
                softcap=args.softcap,
                mask=_mask(call, args.window, q),
            )
            dq[batch, :, rows] += block_dq
            dk[batch, :, kv_rows] += block_dk
            dv[batch, :, kv_rows] += block_dv


def _window_forward(q, k, v, sinks, args: WindowArgs):
    rank, size = args.place()
    seq_len = q.size(2) * size
    acc = torch.promote_types(q.dtype, torch.float32)
    # Rows start empty (lse -inf): the first call into a row merges as a copy of it.
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    plans = [args.plan(seq_len, rank, src) for src in range(size)]
    one_call = args.one_call(q.device)
    # The merge's scratch, as large as the largest call (a tile, where the window cuts).
    rows = max((c[0].stop - c[0].start for p in plans for _, cs in p.calls for c in cs), default=1)
    scratch = MergeScratch(out if one_call else out[:, :, : max(rows, 1)])

    def mask(src: int):
        return args.block_mask(seq_len, rank, src, q) if one_call else None

    halos: dict[int, torch.Tensor] = {}
    if size > 1:
        comm = PeerComm(args.group, side_stream(q.device))
        for peer in range(size):
            if peer == rank:
                continue
            theirs = args.plan(seq_len, peer, rank)  # the peer's queries over my keys
            if theirs.halo:
                comm.send(_pack(k, v, theirs.halo), peer)
            mine = args.plan(seq_len, rank, peer)
            if mine.halo:
                halos[peer] = k.new_empty((2, k.size(0), k.size(1), mine.halo_rows, k.size(3)))
                comm.recv(halos[peer], peer)
        comm.commit()
    # The own block first: every row sees itself, so no row's lse is -inf after it.
    _forward_calls(q, k, v, plans[rank], out, lse, scratch, args, mask(rank))
    if size > 1:
        comm.wait()
    for peer, halo in halos.items():
        _forward_calls(q, halo[0], halo[1], plans[peer], out, lse, scratch, args, mask(peer))
    if sinks is not None:
        fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse, halos


def _window_backward(grad_out, q, k, v, out, lse, sinks, halos: dict[int, torch.Tensor], args):
    rank, size = args.place()
    seq_len = q.size(2) * size
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    incoming: dict[int, torch.Tensor] = {}
    one_call = args.one_call(q.device)

    def mask(src: int):
        return args.block_mask(seq_len, rank, src, q) if one_call else None

    if size > 1:
        comm = PeerComm(args.group, side_stream(q.device))
        # The halos' gradients first, so that they travel home while the own block computes.
        for peer, halo in halos.items():
            grads = torch.zeros(halo.shape, dtype=acc, device=halo.device)
            plan = args.plan(seq_len, rank, peer)
            _backward_calls(
                grad_out, q, halo[0], halo[1], out, lse, plan, dq, grads[0], grads[1], args,
                mask(peer),
            )  # fmt: skip
            comm.send(grads, peer)
        for peer in range(size):
            theirs = args.plan(seq_len, peer, rank) if peer != rank else None
            if theirs is not None and theirs.halo:
                incoming[peer] = k.new_empty(
                    (2, k.size(0), k.size(1), theirs.halo_rows, k.size(3)), dtype=acc
                )
                comm.recv(incoming[peer], peer)
        comm.commit()
    _backward_calls(
        grad_out, q, k, v, out, lse, args.plan(seq_len, rank, rank), dq, dk, dv, args, mask(rank)
    )
    if size > 1:
        comm.wait()
    for peer, grads in incoming.items():
        at = 0
        for start, stop in args.plan(seq_len, peer, rank).halo:
            dk[:, :, start:stop] += grads[0, :, :, at : at + stop - start]
            dv[:, :, start:stop] += grads[1, :, :, at : at + stop - start]
            at += stop - start
    d_sinks = None if sinks is None else sink_gradient(grad_out, out, lse, sinks)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sinks


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, args: WindowArgs):
        # gloo sends only contiguous buffers.
        k, v = k.contiguous(), v.contiguous()
        out, lse, halos = _window_forward(q, k, v, sinks, args)
        ctx.peers = list(halos)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *halos.values())
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, sinks, *halo_list = ctx.saved_tensors
        halos = dict(zip(ctx.peers, halo_list, strict=True))
        dq, dk, dv, d_sinks = _window_backward(
            grad_out.contiguous(), q, k, v, out, lse, sinks, halos, ctx.args
        )
        return dq, dk, dv, d_sinks, None


def window_attention_on(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    args: WindowArgs,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Causal attention of checked inputs through the pieces of this module: a sliding window
    (``args.window``; None: the whole causal prefix), documents, soft-capped scores and sinks,
    at one process (``args.group`` and ``args.shards`` None) or over a ring's ranks (the halo
    exchange). Differentiable in q, k, v and ``sinks``."""
    out, lse = _WindowAttention.apply(q, k, v, sinks, args)
    return (out, lse) if return_lse else out


def halo_plan_bytes(
    documents: CuSeqlens | None,
    seq_len: int,
    shards: RingShards,
    window: int,
    row_bytes: int,
) -> list[int]:
    """Bytes each ring rank receives in a local layer's forward halo exchange (K and V rows of
    ``row_bytes`` each; summed over the ranks, what they send), pure: no process group; what
    the benchmark and the planner's tests check the exchange against."""
    received = []
    for rank in range(shards.ring_size):
        rows = sum(
            block_plan(documents, seq_len, shards, rank, peer, window).halo_rows
            for peer in range(shards.ring_size)
            if peer != rank
        )
        received.append(2 * rows * row_bytes)
    return received
