"""The balanced CP sharding: every rank holds exactly S/N tokens, every token is held once, and
the busiest rank's attention area under the document mask is within 1.05 of the mean at CP 2,
4, 8 and 16, on long-tailed length distributions and on the worst cases of a fixed sharding,
where zigzag is far off; one document is exactly zigzag. The area is the schedule's own count
(`attention_area`, which walks the ring's blocks), not the balancer's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from ctxlaunch.cp import attention_area, shard_for_rank, shard_positions, unshard_from_shards
from ctxlaunch.cp.balance import TARGET, balanced_spans, rank_areas, zigzag_spans
from ctxlaunch.cp.sharding import rank_spans
from devkit.doc_lengths import LONG_TAILED, lengths, pack, worst_cases

SEQ_LEN = 65536
BOUND = 1.05


def _check_partition(bounds: tuple[int, ...], world_size: int) -> None:
    spans = balanced_spans(bounds, world_size)
    assert len(spans) == world_size
    held = sorted(p for rank in spans for start, n in rank for p in range(start, start + n))
    assert held == list(range(bounds[-1])), "every token held exactly once"
    for rank in spans:
        assert sum(n for _, n in rank) == bounds[-1] // world_size
        assert list(rank) == sorted(rank), "a rank's runs are in ascending position"


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
@pytest.mark.parametrize("name", sorted(LONG_TAILED))
def test_long_tailed_lengths_are_balanced(name, world_size):
    sequences = pack(lengths(LONG_TAILED[name], seed=1), SEQ_LEN, 8)
    worst_zigzag = 1.0
    for bounds in sequences:
        _check_partition(bounds, world_size)
        balanced = attention_area([bounds], SEQ_LEN, world_size, "balanced")
        assert balanced.busiest_over_mean <= BOUND, (bounds[:8], balanced.per_rank_computed)
        worst_zigzag = max(
            worst_zigzag, attention_area([bounds], SEQ_LEN, world_size).busiest_over_mean
        )
    # The distributions are hard for a fixed sharding: the test would pass vacuously otherwise.
    assert worst_zigzag > 1.25


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_worst_cases_are_balanced(world_size):
    for name, bounds in worst_cases(SEQ_LEN, world_size).items():
        _check_partition(bounds, world_size)
        area = attention_area([bounds], SEQ_LEN, world_size, "balanced")
        assert area.busiest_over_mean <= BOUND, (name, area.per_rank_computed)
        # The balancer's own count agrees with the ring schedule's.
        assert tuple(rank_areas(bounds, balanced_spans(bounds, world_size))) == (
            area.per_rank_computed
        )
    # One document longer than a rank's share is where zigzag fails most.
    long_one = worst_cases(SEQ_LEN, world_size)["one document longer than a rank's share"]
    assert attention_area([long_one], SEQ_LEN, world_size).busiest_over_mean > 1.5


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_one_document_is_zigzag(world_size):
    assert balanced_spans((0, SEQ_LEN), world_size) == zigzag_spans(SEQ_LEN, world_size)
    for rank in range(world_size):
        assert torch.equal(
            shard_positions(SEQ_LEN, rank, world_size, "balanced", documents=[(0, SEQ_LEN)])[0],
            shard_positions(SEQ_LEN, rank, world_size, "zigzag"),
        )
    # Its runs: rank 1 of 4 holds chunks 1 and 6 of 8.
    assert rank_spans((0, 32), 1, 4, "balanced") == rank_spans((0, 32), 1, 4, "zigzag")
    assert rank_spans((0, 32), 1, 4, "zigzag") == ((4, 4), (24, 4))


def test_zigzag_is_kept_where_it_is_balanced():
    """Many short documents: zigzag is within the target already, and keeps two runs a rank."""
    bounds = worst_cases(SEQ_LEN, 4)["thousands of short documents"]
    area = attention_area([bounds], SEQ_LEN, 4, "zigzag")
    assert area.busiest_over_mean <= TARGET
    assert balanced_spans(bounds, 4) == zigzag_spans(SEQ_LEN, 4)


def test_shards_differ_per_batch_element_and_round_trip():
    """Each batch element is placed from its own documents; sharding then unsharding any
    per-token tensor gives it back, and each shard holds the tokens at its positions."""
    seq_len, world_size = 96, 4
    documents = [(0, 5, 7, 45, 52, 96), (0, 96), (0, 24, 48, 96)]
    tokens = torch.arange(seq_len).repeat(3, 1)
    x = torch.randn(3, 2, seq_len, 5)
    shards = []
    for rank in range(world_size):
        positions = shard_positions(seq_len, rank, world_size, "balanced", documents=documents)
        assert positions.shape == (3, seq_len // world_size)
        held = shard_for_rank(tokens, rank, world_size, 1, "balanced", documents)
        assert torch.equal(held, positions)
        shards.append(shard_for_rank(x, rank, world_size, 2, "balanced", documents))
    assert not torch.equal(shards[0][0], shards[0][1]), "batch elements are placed apart"
    torch.testing.assert_close(unshard_from_shards(shards, 2, "balanced", documents), x)


def test_lengths_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"divisible by 2\*N = 8"):
        balanced_spans((0, 5, 36), 4)
