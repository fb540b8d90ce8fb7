"""Document-length distributions for the CP balance tests and benchmarks: seeded streams of
document lengths, long-tailed as pre-training corpora are (many short web documents, a few
books or code repositories), the worst cases of a sharding, and packing a stream into
sequences at fixed offsets as the trainer's packed data does (runtime/data/packing.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

Sampler = Callable[[random.Random], float]

LONG_TAILED: dict[str, Sampler] = {
    # Web text: median 600 tokens, a lognormal's long right tail.
    "web (lognormal, median 600)": lambda r: r.lognormvariate(math.log(600), 1.4),
    # 95 % web documents, 5 % books or code repositories of tens of thousands of tokens.
    "web + 5 % books (median 60K)": lambda r: (
        r.lognormvariate(math.log(60_000), 0.8)
        if r.random() < 0.05
        else r.lognormvariate(math.log(500), 1.2)
    ),
    # A power law: P(L > x) ~ x^-1.1 above 100 tokens.
    "pareto (alpha 1.1, min 100)": lambda r: 100 * r.paretovariate(1.1),
}
"""Named long-tailed length distributions (a sampler draws one document's length)."""


def lengths(sampler: Sampler, seed: int) -> Iterator[int]:
    """An endless seeded stream of document lengths (at least 1 token each)."""
    rng = random.Random(seed)
    while True:
        yield max(1, int(sampler(rng)))


def pack(stream: Iterator[int], seq_len: int, count: int) -> list[tuple[int, ...]]:
    """``count`` consecutive sequences of ``seq_len`` tokens cut from a stream of documents at
    fixed offsets: per sequence its document boundaries (0, ..., seq_len); a document cut by a
    sequence's end continues at the start of the next."""
    sequences = []
    carry = 0
    for _ in range(count):
        bounds = [0]
        filled = 0
        while filled < seq_len:
            length = carry or next(stream)
            take = min(length, seq_len - filled)
            filled += take
            carry = length - take
            bounds.append(filled)
        sequences.append(tuple(bounds))
    return sequences


def worst_cases(seq_len: int, world_size: int, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """Sequences that defeat a fixed sharding, one per name: a single document; one document
    longer than a rank's share among short ones; thousands of short documents (a few tokens
    each); two documents at the halves; documents shorter than 2N tokens, which cannot be
    cut head-tail."""
    rng = random.Random(seed)
    share = seq_len // world_size

    def stream_from(first: list[int], low: int, high: int) -> tuple[int, ...]:
        bounds = [0]
        for length in first:
            bounds.append(bounds[-1] + length)
        while bounds[-1] < seq_len:
            bounds.append(min(seq_len, bounds[-1] + rng.randint(low, high)))
        return tuple(bounds)

    return {
        "one document": (0, seq_len),
        "one document longer than a rank's share": stream_from([share + share // 4 + 7], 50, 2000),
        "thousands of short documents": stream_from([], 1, max(2, seq_len // 2000)),
        "two halves": (0, seq_len // 2, seq_len),
        "a long document then short ones": stream_from([seq_len // 3], 1, 2 * world_size - 1),
    }
