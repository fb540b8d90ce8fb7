"""Sharding shardings: pure index helpers (no process group)."""

import pytest
import torch

from ctxlaunch.cp import (
    shard_for_rank,
    shard_indices,
    shard_positions,
    unshard_from_shards,
    unshard_indices,
)
from ctxlaunch.cp.sharding import group_chunk_plan, num_chunks


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shard_unshard_round_trip(sharding, world_size):
    x = torch.randn(2, 3, 8 * world_size, 5)
    shards = [shard_for_rank(x, r, world_size, dim=2, sharding=sharding) for r in range(world_size)]
    assert all(s.shape == (2, 3, 8, 5) for s in shards)
    torch.testing.assert_close(unshard_from_shards(shards, dim=2, sharding=sharding), x)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_shard_holds_the_tokens_at_its_positions(sharding):
    seq_len, world_size = 32, 4
    tokens = torch.arange(seq_len).view(1, seq_len)
    for r in range(world_size):
        shard = shard_for_rank(tokens, r, world_size, dim=1, sharding=sharding)
        assert torch.equal(shard[0], shard_positions(seq_len, r, world_size, sharding))


def test_zigzag_positions():
    # 16 tokens, 2N = 8 chunks of 2: rank 1 holds chunks 1 and 6.
    assert shard_positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert shard_positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_unshard_indices_invert_shard_indices(sharding):
    order = shard_indices(24, 3, sharding)
    assert sorted(order.tolist()) == list(range(24))
    assert torch.equal(order[unshard_indices(24, 3, sharding)], torch.arange(24))


@pytest.mark.parametrize(
    "seq_len, world_size, sharding, rule",
    [(30, 4, "zigzag", "2*N = 8"), (12, 8, "zigzag", "2*N = 16"), (10, 4, "contiguous", "N = 4")],
)
def test_illegal_lengths_are_rejected_with_the_rule(seq_len, world_size, sharding, rule):
    with pytest.raises(ValueError) as err:
        shard_positions(seq_len, 0, world_size, sharding)
    message = str(err.value)
    assert (
        f"sequence length {seq_len}" in message and f"N={world_size}" in message and rule in message
    )
    with pytest.raises(ValueError, match=f"sequence length {seq_len}"):
        shard_for_rank(torch.zeros(1, 1, seq_len, 1), 0, world_size, dim=2, sharding=sharding)


def test_unknown_layout_and_rank_are_rejected():
    with pytest.raises(ValueError, match="sharding='striped' is not supported"):
        shard_positions(16, 0, 2, "striped")
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        shard_positions(16, 2, 2, "zigzag")


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize(
    "ring_size, ulysses_size", [(2, 2), (2, 4), (4, 2), (3, 2), (1, 4), (4, 1)]
)
def test_ulysses_group_gathers_a_ring_shard(sharding, ring_size, ulysses_size):
    """The fact hybrid attention rests on: Ulysses group r of U consecutive CP ranks gathers, in
    ascending order, exactly ring rank r's shard of a ring of R ranks under the same sharding."""
    world_size = ring_size * ulysses_size
    seq_len = 4 * num_chunks(world_size, sharding)
    chunk = seq_len // num_chunks(world_size, sharding)
    for r in range(ring_size):
        members = list(range(r * ulysses_size, (r + 1) * ulysses_size))
        member_positions = [
            shard_positions(seq_len, m, world_size, sharding).view(-1, chunk) for m in members
        ]
        gathered = torch.empty(
            len(group_chunk_plan(members, world_size, sharding)), chunk, dtype=torch.long
        )
        for member, slot, dest in group_chunk_plan(members, world_size, sharding):
            gathered[dest] = member_positions[member][slot]
        assert torch.equal(gathered.flatten(), shard_positions(seq_len, r, ring_size, sharding))
