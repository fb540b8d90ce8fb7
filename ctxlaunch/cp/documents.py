# Shapes: cu_seqlens: one tuple per batch element of global document boundaries 0 = b_0 < ... < b_n = S.
"""Document masks over context parallelism: which rectangles of a block a packed sequence needs.

A packed sequence holds documents as contiguous runs of tokens, described by their global
boundaries (cumulative sequence lengths over the whole sequence, ``cu_seqlens``, one tuple per
batch element). Under a document mask a query attends only to keys of its own document, causally.

A rank's shard is one contiguous run of the sequence (contiguous sharding), two (zigzag: chunks
i and 2N-1-i), or the runs the balanced sharding places (``balance.py``), always in ascending
position. For a block (these queries over some rank's K/V shard) the visible area is a set of
rectangles, one per (q run, kv run, document) intersection: a document's rows in the q run see
that document's rows in the kv run fully when the kv run lies wholly before the q run, and
causally when it is the same run (the diagonal, where a top-left causal mask is exact because
the rectangle is square). Block pairs and run pairs that share no document yield no rectangle:
they are skipped, never computed and masked. Each rectangle runs through the dense kernels on
row/column slices, so no mask tensor exists on CPU or CUDA (the per-rectangle path, the
reference); on CUDA ``flex.py`` runs a whole block in one FlexAttention call instead.

Unmasked causal attention is the special case of one document; ``ring._block`` computes it
without the bookkeeping.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from .balance import span_area
from .sharding import check_seq_len, rank_spans

CuSeqlens = tuple[tuple[int, ...], ...]
"""Per batch element, the global document boundaries: (0, end of doc 0, ..., seq_len)."""

Piece = tuple[slice, slice, bool]
"""(q_rows, kv_rows, causal) of one rectangle, in local row indices of the two shards."""

Run = tuple[int, int, int]
"""(local start, global start, length) of a contiguous run of a shard."""


def normalise_documents(documents: Sequence[Sequence[int]], batch: int, seq_len: int) -> CuSeqlens:
    """Check ``documents`` (one boundary list per batch element) and return it as tuples.

    Raises ValueError unless there are ``batch`` lists, each strictly increasing from 0 to
    ``seq_len`` (the global sequence length).
    """
    if len(documents) != batch:
        raise ValueError(f"documents has {len(documents)} boundary lists for a batch of {batch}")
    result = []
    for b, bounds in enumerate(documents):
        bounds = tuple(int(x) for x in bounds)
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len:
            raise ValueError(
                f"documents[{b}] = {bounds} must run from 0 to the sequence length {seq_len}"
            )
        if any(a >= c for a, c in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"documents[{b}] = {bounds} must be strictly increasing")
        result.append(bounds)
    return tuple(result)


def check_documents(
    documents: Sequence[Sequence[int]] | None, causal: bool, batch: int, seq_len: int
) -> CuSeqlens | None:
    """``normalise_documents`` for the attention functions (None passes through); a document
    mask is causal, so ``causal=False`` with documents is a ValueError."""
    if documents is None:
        return None
    if not causal:
        raise ValueError("documents (a document mask) needs causal=True")
    return normalise_documents(documents, batch, seq_len)


def batch_groups(documents: CuSeqlens) -> list[tuple[slice, tuple[int, ...]]]:
    """Consecutive batch elements with the same boundaries, as (batch slice, boundaries):
    one kernel call serves them all."""
    groups: list[tuple[slice, tuple[int, ...]]] = []
    start = 0
    for b in range(1, len(documents) + 1):
        if b == len(documents) or documents[b] != documents[start]:
            groups.append((slice(start, b), documents[start]))
            start = b
    return groups


@dataclass(frozen=True)
class RingShards:
    """How the shards a ring passes around are cut: the CP sharding over the whole CP group of
    ``ring_size`` x ``ulysses`` ranks, ring rank r holding the tokens of CP ranks rU..rU+U-1
    in ascending position (what a hybrid's Ulysses group gathers; U = 1 for a plain ring)."""

    sharding: str
    ring_size: int
    ulysses: int = 1

    @property
    def cp_size(self) -> int:
        return self.ring_size * self.ulysses

    def runs(self, bounds: tuple[int, ...], ring_rank: int) -> tuple[Run, ...]:
        """The contiguous runs of ring rank ``ring_rank``'s shard of the sequence of
        ``bounds``: (local start, global start, length), ascending."""
        # Only the balanced sharding reads the boundaries: key the others on the length alone.
        key = bounds if self.sharding == "balanced" else (0, bounds[-1])
        return _ring_runs(key, self, ring_rank)


@functools.lru_cache(maxsize=4096)
def _ring_runs(bounds: tuple[int, ...], shards: RingShards, ring_rank: int) -> tuple[Run, ...]:
    u = shards.ulysses
    spans = sorted(
        span
        for member in range(ring_rank * u, ring_rank * u + u)
        for span in rank_spans(bounds, member, shards.cp_size, shards.sharding)
    )
    runs: list[Run] = []
    local = 0
    for start, length in spans:
        if runs and runs[-1][1] + runs[-1][2] == start:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
        else:
            runs.append((local, start, length))
        local += length
    return tuple(runs)


def shard_runs(rank: int, world_size: int, sharding: str, s_local: int) -> tuple[Run, ...]:
    """The contiguous runs of ``rank``'s shard of an unmasked sequence (balanced is zigzag
    there): (local start, global start, length)."""
    return RingShards(sharding, world_size).runs((0, s_local * world_size), rank)


def documents_in(bounds: tuple[int, ...], start: int, stop: int) -> range:
    """Indices of the documents overlapping global tokens [start, stop)."""
    return range(bisect.bisect_right(bounds, start) - 1, bisect.bisect_left(bounds, stop))


def _overlap(run: Run, bounds: tuple[int, ...], doc: int) -> slice:
    """Local rows of ``run`` that belong to document ``doc``."""
    local, first, length = run
    lo, hi = max(bounds[doc], first), min(bounds[doc + 1], first + length)
    return slice(local + lo - first, local + hi - first)


def block_pieces(
    bounds: tuple[int, ...], q_runs: Sequence[Run], kv_runs: Sequence[Run]
) -> list[Piece]:
    """The rectangles of a block under a document mask, the diagonal (causal) ones first.

    Runs are disjoint and ascending. Every query row lies in exactly one diagonal rectangle
    when ``q_runs`` are ``kv_runs`` (a rank's own block), so the diagonal pieces cover each
    local row once and can initialise the output before the others are merged into it.
    """
    diagonal: list[Piece] = []
    full: list[Piece] = []
    kv_starts = [run[1] for run in kv_runs]
    for q_run in q_runs:
        q_start, q_stop = q_run[1], q_run[1] + q_run[2]
        at = bisect.bisect_left(kv_starts, q_start)
        if at < len(kv_runs) and kv_starts[at] == q_start:
            # The same run (only a rank's own block has it): each of its documents, causally.
            for doc in documents_in(bounds, q_start, q_stop):
                rows = _overlap(q_run, bounds, doc)
                diagonal.append((rows, rows, True))
        # Runs are disjoint, so a K/V run that starts earlier ends before this one starts: only
        # the document holding this run's first token can reach back into it, and only into the
        # K/V runs that end after that document starts (the ones just before, in order).
        doc = bisect.bisect_right(bounds, q_start) - 1
        earlier = at - 1
        while earlier >= 0 and kv_runs[earlier][1] + kv_runs[earlier][2] > bounds[doc]:
            earlier -= 1
        for kv_run in kv_runs[earlier + 1 : at]:
            full.append((_overlap(q_run, bounds, doc), _overlap(kv_run, bounds, doc), False))
        # K/V runs that come later are hidden by causality.
    return diagonal + full


def ring_rank_areas(
    documents: Sequence[Sequence[int]] | None,
    seq_len: int,
    world_size: int,
    sharding: str,
    ulysses: int = 1,
    batch: int = 1,
) -> tuple[int, ...]:
    """The attention area each ring rank computes for a micro-batch (one boundary tuple per
    sequence; None: unmasked, ``batch`` sequences), summed over its sequences: per CP rank
    for a ring, per Ulysses group for a hybrid (``ulysses`` = U), one figure for Ulysses
    alone (U = N), whose ranks all compute the whole sequence on their heads. Every rank of a
    ring waits for the busiest at each hop: max / mean is the step's balance."""
    ring_size = world_size // ulysses
    shards = RingShards(sharding, ring_size, ulysses)
    sequences = [tuple(b) for b in documents] if documents is not None else [(0, seq_len)] * batch
    areas = [0] * ring_size
    for bounds in sequences:
        for rank in range(ring_size):
            areas[rank] += sum(
                span_area(bounds, start, length) for _, start, length in shards.runs(bounds, rank)
            )
    return tuple(areas)


@functools.lru_cache(maxsize=1024)
def ring_block_pieces(
    bounds: tuple[int, ...], shards: RingShards, rank: int, src: int
) -> tuple[Piece, ...]:
    """``block_pieces`` of ring rank ``rank``'s queries over ring rank ``src``'s K/V under the
    mask of ``bounds``. Cached: every layer of a step, forward and backward, asks again."""
    q_runs = shards.runs(bounds, rank)
    kv_runs = q_runs if src == rank else shards.runs(bounds, src)
    return tuple(block_pieces(bounds, q_runs, kv_runs))


def _area(piece: Piece) -> int:
    rows, cols, causal = piece
    n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
    return n_rows * (n_rows + 1) // 2 if causal else n_rows * n_cols


@dataclass(frozen=True)
class AttentionArea:
    """How much of the attention score matrix a document-masked CP schedule computes, counted
    in (query, key) pairs summed over the batch; causal squares of n rows count n(n+1)/2."""

    computed: int
    """Pairs the document-masked schedule computes (exactly each document's causal triangle)."""
    unmasked: int
    """Pairs the unmasked causal schedule computes (the whole causal triangle)."""
    per_rank_computed: tuple[int, ...]
    """Pairs each CP rank computes under the mask (the slowest rank sets the step time)."""
    per_rank_unmasked: tuple[int, ...]
    blocks_computed: int
    """(rank, K/V shard) blocks with at least one rectangle, over all ranks and the batch."""
    blocks_skipped: int
    """Blocks the unmasked schedule computes that share no document, so are skipped."""
    pieces: int
    """Kernel calls (rectangles) of the forward pass over all ranks."""

    @property
    def computed_fraction(self) -> float:
        """Computed area over the unmasked causal area."""
        return self.computed / self.unmasked

    @property
    def skipped_fraction(self) -> float:
        return 1.0 - self.computed_fraction

    @property
    def critical_fraction(self) -> float:
        """The busiest rank's masked area over the busiest rank's unmasked area."""
        return max(self.per_rank_computed) / max(self.per_rank_unmasked)

    @property
    def busiest_over_mean(self) -> float:
        """The busiest ring rank's masked area over the mean: what every other rank waits for
        (1.0 is perfect balance)."""
        mean = sum(self.per_rank_computed) / len(self.per_rank_computed)
        return max(self.per_rank_computed) / mean if mean else 1.0


def attention_area(
    documents: Sequence[Sequence[int]],
    seq_len: int,
    world_size: int,
    sharding: str = "zigzag",
    ulysses: int = 1,
) -> AttentionArea:
    """The attention area the document-masked ring schedule computes, and what it saves against
    the unmasked causal schedule, for one boundary list per batch element. Pure (no process
    group). ``world_size`` is the CP size; with ``ulysses`` = U > 1 the ring is a hybrid's, of
    world_size / U ranks each holding a Ulysses group's tokens (its per-rank figures are per
    Ulysses group). Ulysses alone computes the same per-document triangles on head shards."""
    check_seq_len(seq_len, world_size, sharding)
    if ulysses < 1 or world_size % ulysses:
        raise ValueError(f"ulysses={ulysses} must divide the CP size {world_size}")
    cu = normalise_documents(documents, len(documents), seq_len)
    ring_size = world_size // ulysses
    shards = RingShards(sharding, ring_size, ulysses)
    single = (0, seq_len)
    computed = [0] * ring_size
    unmasked = [0] * ring_size
    blocks_computed = blocks_skipped = pieces = 0
    for bounds in cu:
        for rank in range(ring_size):
            q_runs = shards.runs(bounds, rank)
            plain_q = shards.runs(single, rank)
            for src in range(ring_size):
                kv_runs = shards.runs(bounds, src)
                plain = block_pieces(single, plain_q, shards.runs(single, src))
                masked = block_pieces(bounds, q_runs, kv_runs)
                unmasked[rank] += sum(map(_area, plain))
                computed[rank] += sum(map(_area, masked))
                pieces += len(masked)
                if masked:
                    blocks_computed += 1
                elif plain:
                    blocks_skipped += 1
    return AttentionArea(
        computed=sum(computed),
        unmasked=sum(unmasked),
        per_rank_computed=tuple(computed),
        per_rank_unmasked=tuple(unmasked),
        blocks_computed=blocks_computed,
        blocks_skipped=blocks_skipped,
        pieces=pieces,
    )
