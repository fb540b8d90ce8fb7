"""How unevenly a fixed CP sharding spreads a document mask's attention over the ring's ranks.

Under a document mask a query attends only to the earlier tokens of its own document, so a ring
rank's attention work depends on which documents its shard holds; every rank waits for the
busiest at each hop, and the step follows the busiest rank's area, not the mean. Zigzag and
contiguous shards are fixed, so their busiest rank depends on the lengths; the balanced sharding
(`parallel.cp_sharding: balanced`) places each sequence by its documents and holds the busiest
within a few percent of the mean (BENCHMARKS.md, balanced CP sharding), which the planner costs
as the mean.

The planner knows the token-weighted mean document length only (`data.mean_document_tokens`),
so `ring_imbalance` draws a seeded stream of exponentially distributed lengths with that
token-weighted mean (an exponential's token-weighted mean is twice its mean), packs it into
sequences at fixed offsets as the trainer does, and counts each rank's area exactly. Real
corpora are more long-tailed than an exponential and leave zigzag further off (the benchmark's
web, books and Pareto lengths): the figure is a floor on the fixed shardings' imbalance.
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Sequence

SEQUENCES = 16
"""Packed sequences the estimate averages over."""
MANY_DOCUMENTS_PER_CHUNK = 64
"""When a sharding chunk holds at least this many mean-length documents, every chunk holds
about the same area and the estimate is 1 (counting millions of documents buys nothing)."""


def _spans(seq_len: int, ring_degree: int, sharding: str) -> list[list[tuple[int, int]]]:
    """(start, length) runs each ring rank holds under a fixed sharding."""
    if sharding == "contiguous":
        share = seq_len // ring_degree
        return [[(rank * share, share)] for rank in range(ring_degree)]
    chunk = seq_len // (2 * ring_degree)
    return [
        [(rank * chunk, chunk), ((2 * ring_degree - 1 - rank) * chunk, chunk)]
        for rank in range(ring_degree)
    ]


def _run_area(bounds: Sequence[int], start: int, length: int) -> int:
    """(query, key) pairs of the queries at [start, start + length) under the document mask:
    each query attends to its document's tokens up to itself."""
    total = 0
    end = start + length
    index = bisect.bisect_right(bounds, start) - 1
    while index < len(bounds) - 1 and bounds[index] < end:
        doc_start, doc_end = bounds[index], bounds[index + 1]
        low, high = max(start, doc_start) - doc_start, min(end, doc_end) - doc_start
        total += high * (high + 1) // 2 - low * (low + 1) // 2
        index += 1
    return total


def _packed(seq_len: int, document_tokens: float, count: int) -> list[list[int]]:
    """``count`` sequences' document boundaries, cut from a seeded stream of exponential
    lengths whose token-weighted mean is ``document_tokens``, at fixed offsets."""
    rng = random.Random(0)
    mean = document_tokens / 2
    sequences = []
    carry = 0
    for _ in range(count):
        bounds = [0]
        while bounds[-1] < seq_len:
            length = carry or max(1, round(rng.expovariate(1 / mean)))
            take = min(length, seq_len - bounds[-1])
            carry = length - take
            bounds.append(bounds[-1] + take)
        sequences.append(bounds)
    return sequences


@functools.lru_cache(maxsize=256)
def ring_imbalance(
    seq_len: int, ring_degree: int, sharding: str, document_tokens: float | None
) -> float:
    """The busiest ring rank's document-masked attention area over the ranks' mean, averaged
    over packed sequences (see the module's docstring for the length model): 1 for one rank,
    no known document length, or the balanced sharding."""
    if ring_degree <= 1 or not document_tokens or sharding == "balanced":
        return 1.0
    chunk = seq_len / (ring_degree if sharding == "contiguous" else 2 * ring_degree)
    if chunk >= MANY_DOCUMENTS_PER_CHUNK * document_tokens:
        return 1.0
    spans = _spans(seq_len, ring_degree, sharding)
    ratios = []
    for bounds in _packed(seq_len, document_tokens, SEQUENCES):
        areas = [sum(_run_area(bounds, s, n) for s, n in runs) for runs in spans]
        ratios.append(max(areas) * ring_degree / sum(areas))
    return sum(ratios) / len(ratios)
