# Shapes: bounds = (0, end of doc 0, ..., S) of one packed sequence; a rank holds S/N of its tokens.
"""The ``balanced`` CP sharding: which tokens of a packed, document-masked sequence each CP rank
holds, so that every rank computes the same attention area.

Under a document mask a query at offset j of its document attends to j + 1 keys, so a rank's
attention area is the sum of that weight over the queries it holds, whichever algorithm runs
(ring, Ulysses or hybrid). Zigzag equalises it for one document (the plain causal triangle);
packed documents restart the weight, and zigzag's busiest rank then does up to 1.7x the mean.
The balanced sharding places documents instead of fixed chunks:

- a long document is cut head-tail over all N ranks, as torch's per-document load balancer
  does (2N chunks, rank i holding chunks i and 2N-1-i): every rank gets the same area of it.
  Lengths need not divide: the chunks differ by at most one token.
- the other documents stay whole, each on one rank (so it needs no ring hop at all), placed
  largest first on the rank with the least area that has room for it (longest processing time
  first under a token budget); what fits nowhere whole fills the last room, cut where it must.
- how many of the longest documents are cut head-tail is searched, from none up, for the
  fewest that bring the busiest rank within ``TARGET`` of the mean.

Where zigzag already holds the busiest rank within ``TARGET`` of the mean (a sequence of many
short documents), the balanced sharding is zigzag, whose two runs per rank are the fewest.

Every rank holds exactly S/N tokens, as its runs: (global start, length) in ascending order,
which is also the order of the rank's local rows. A single document gives exactly zigzag's two
chunks. Pure Python: no tensors, no process group; the result depends only on the boundaries
and N, so every rank of a CP group computes the same sharding from the same batch.
"""

from __future__ import annotations

import bisect
import functools
import heapq
from collections.abc import Sequence

Span = tuple[int, int]
"""(global start, length) of a run of consecutive tokens."""

TARGET = 1.02
"""The busiest rank's area over the mean that the search stops at (the fewest documents cut
head-tail that reach it); the tests hold the result to 1.05."""


def document_area(length: int) -> int:
    """(query, key) pairs of one document's causal triangle: L (L + 1) / 2."""
    return length * (length + 1) // 2


def span_area(bounds: Sequence[int], start: int, length: int) -> int:
    """The attention area of the queries at global tokens [start, start + length) under the
    document mask of ``bounds``: the sum, over those queries, of their offset in their document
    plus one."""
    area = 0
    stop = start + length
    doc = bisect.bisect_right(bounds, start) - 1
    while start < stop:
        doc_start, doc_stop = bounds[doc], bounds[doc + 1]
        end = min(stop, doc_stop)
        area += document_area(end - doc_start) - document_area(start - doc_start)
        start, doc = end, doc + 1
    return area


def rank_areas(bounds: Sequence[int], runs: Sequence[Sequence[Span]]) -> list[int]:
    """Each rank's attention area when rank i holds ``runs[i]``."""
    return [sum(span_area(bounds, start, length) for start, length in spans) for spans in runs]


def _merged(spans: list[Span]) -> tuple[Span, ...]:
    """Spans in ascending order, adjacent ones joined."""
    out: list[list[int]] = []
    for start, length in sorted(spans):
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((start, length) for start, length in out)


def zigzag_spans(seq_len: int, world_size: int) -> tuple[tuple[Span, ...], ...]:
    """Zigzag's runs: rank i holds chunks i and 2N-1-i of 2N equal chunks."""
    chunk = seq_len // (2 * world_size)
    return tuple(
        _merged([(r * chunk, chunk), ((2 * world_size - 1 - r) * chunk, chunk)])
        for r in range(world_size)
    )


class _Placement:
    """One candidate: the runs, tokens and area of each rank as documents are placed."""

    def __init__(self, world_size: int, capacity: int):
        self.spans: list[list[Span]] = [[] for _ in range(world_size)]
        self.tokens = [0] * world_size
        self.area = [0] * world_size
        self.capacity = capacity

    def add(self, rank: int, doc_start: int, offset: int, length: int) -> None:
        """Rank ``rank`` takes tokens [offset, offset + length) of the document at doc_start."""
        if length <= 0:
            return
        self.spans[rank].append((doc_start + offset, length))
        self.tokens[rank] += length
        self.area[rank] += document_area(offset + length) - document_area(offset)

    def cut_head_tail(self, doc_start: int, length: int) -> None:
        """Cut a document into 2N chunks, rank i taking chunks i and 2N-1-i; the remainder's
        extra tokens go to the ranks holding the fewest tokens so far, one each."""
        n = len(self.tokens)
        base, extra = divmod(length, 2 * n)
        by_tokens = sorted(range(n), key=lambda r: (self.tokens[r], r))
        head = [base] * n
        tail = [base] * n
        for i in range(extra):
            rank = by_tokens[i % n]
            if i < n:
                head[rank] += 1
            else:
                tail[rank] += 1
        offset = 0
        for rank in range(n):
            self.add(rank, doc_start, offset, head[rank])
            offset += head[rank]
        for rank in reversed(range(n)):
            self.add(rank, doc_start, offset, tail[rank])
            offset += tail[rank]

    def place_whole(self, documents: list[Span]) -> list[Span]:
        """Each document, largest first, whole on the rank with the least area that has room;
        returns those that fit nowhere whole."""
        left: list[Span] = []
        heap = [(self.area[r], r) for r in range(len(self.area))]
        heapq.heapify(heap)
        for start, length in documents:
            skipped = []
            while heap and self.capacity - self.tokens[heap[0][1]] < length:
                skipped.append(heapq.heappop(heap))
            if heap:
                _, rank = heapq.heappop(heap)
                self.add(rank, start, 0, length)
                heapq.heappush(heap, (self.area[rank], rank))
            else:
                left.append((start, length))
            # A rank without room for this document may have room for a smaller one.
            for item in skipped:
                heapq.heappush(heap, item)
        return left

    def fill(self, documents: list[Span]) -> None:
        """Cut what fits nowhere whole into the room left, the least loaded rank first."""
        for start, length in documents:
            offset = 0
            while offset < length:
                open_ranks = [r for r in range(len(self.tokens)) if self.tokens[r] < self.capacity]
                rank = min(open_ranks, key=lambda r: (self.area[r], r))
                take = min(self.capacity - self.tokens[rank], length - offset)
                self.add(rank, start, offset, take)
                offset += take

    def imbalance(self) -> float:
        mean = sum(self.area) / len(self.area)
        return max(self.area) / mean if mean else 1.0


def _place(
    documents: list[Span], cut: int, world_size: int, capacity: int
) -> tuple[float, tuple[tuple[Span, ...], ...]]:
    """Cut the first ``cut`` of ``documents`` (longest first) head-tail, place the rest."""
    placement = _Placement(world_size, capacity)
    for start, length in documents[:cut]:
        placement.cut_head_tail(start, length)
    placement.fill(placement.place_whole(documents[cut:]))
    return placement.imbalance(), tuple(_merged(spans) for spans in placement.spans)


@functools.lru_cache(maxsize=256)
def balanced_spans(bounds: tuple[int, ...], world_size: int) -> tuple[tuple[Span, ...], ...]:
    """The balanced sharding of one packed sequence (document boundaries ``bounds``, from 0 to
    S, S divisible by 2N) over ``world_size`` ranks: per rank, its runs as (global start,
    length) in ascending order, S/N tokens in all. Cached: the data loader and every attention
    layer of the step ask for the same sequences."""
    seq_len = bounds[-1]
    if world_size < 1 or seq_len % (2 * world_size):
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be sharded over N={world_size} ranks with "
            f"the 'balanced' sharding: it must be divisible by 2*N = {2 * world_size}"
        )
    zigzag = zigzag_spans(seq_len, world_size)
    if len(bounds) == 2 or world_size == 1:
        return zigzag
    areas = rank_areas(bounds, zigzag)
    if max(areas) * world_size <= TARGET * sum(areas):
        # Zigzag is already balanced (many short documents): keep its two runs per rank.
        return zigzag
    capacity = seq_len // world_size
    documents = sorted(
        ((a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)),
        key=lambda doc: (-doc[1], doc[0]),
    )
    # Documents shorter than 2N tokens cannot be cut head-tail.
    cuttable = sum(1 for _, length in documents if length >= 2 * world_size)
    best: tuple[float, tuple[tuple[Span, ...], ...]] | None = None
    tried: dict[int, float] = {}

    def attempt(cut: int) -> float:
        nonlocal best
        result = _place(documents, cut, world_size, capacity)
        tried[cut] = result[0]
        if best is None or result[0] < best[0] - 1e-12:
            best = result
        return result[0]

    # Grow the number cut (0, 1, 2, 4, ...) until one reaches the target, then bisect for the
    # fewest between the last miss and that hit.
    miss, hit, cut = -1, None, 0
    while cut <= cuttable:
        if attempt(cut) <= TARGET:
            hit = cut
            break
        miss, cut = cut, (1 if cut == 0 else 2 * cut)
    if hit is None and cuttable not in tried:
        if attempt(cuttable) <= TARGET:
            hit = cuttable
    if hit is not None:
        while hit - miss > 1:
            middle = (hit + miss) // 2
            if attempt(middle) <= TARGET:
                hit = middle
            else:
                miss = middle
        return _place(documents, hit, world_size, capacity)[1]
    assert best is not None
    return best[1]
