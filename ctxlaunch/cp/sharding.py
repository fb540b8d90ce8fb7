# Shapes: full x (..., S, ...) with S = global length at `dim`; shard (..., S/N, ...); N = CP size.
"""Which tokens each context-parallel rank holds, and moving tensors between full and sharded.

Two shardings:

- ``"zigzag"``: the sequence is cut into 2N equal chunks; rank i holds chunks i and 2N-1-i,
  concatenated in that order. Under a causal mask every rank then does the same work.
- ``"contiguous"``: the sequence is cut into N equal chunks; rank i holds chunk i.

The index helpers are pure (no process group). ``shard_sequence`` needs no communication either;
``unshard_sequence`` all-gathers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SHARDINGS = ("zigzag", "contiguous")


def check_sharding(sharding: str) -> None:
    """Raise ValueError unless ``sharding`` is one of :data:`SHARDINGS`."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is not supported; choose one of {SHARDINGS}")


def num_chunks(world_size: int, sharding: str) -> int:
    """How many equal chunks the sequence is cut into: 2N for zigzag, N for contiguous."""
    check_sharding(sharding)
    return 2 * world_size if sharding == "zigzag" else world_size


def check_seq_len(seq_len: int, world_size: int, sharding: str) -> None:
    """Raise ValueError unless a sequence of ``seq_len`` tokens splits evenly under ``sharding``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    chunks = num_chunks(world_size, sharding)
    if seq_len % chunks != 0:
        rule = "2*N" if sharding == "zigzag" else "N"
        raise ValueError(
            f"sequence length {seq_len} cannot be sharded over N={world_size} ranks with the "
            f"{sharding!r} sharding: it must be divisible by {rule} = {chunks}"
        )


def check_shard_len(q_len: int, kv_len: int, world_size: int, sharding: str) -> None:
    """Raise ValueError unless local q and K/V shards are equally long and form a legal sequence."""
    if q_len != kv_len:
        raise ValueError(f"q and k/v shards must have the same length, got {q_len} and {kv_len}")
    check_seq_len(q_len * world_size, world_size, sharding)


def shard_chunk_ids(rank: int, world_size: int, sharding: str) -> list[int]:
    """Chunk ids (out of :func:`num_chunks`) that ``rank`` holds, in the order it stores them."""
    check_sharding(sharding)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if sharding == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    return [rank]


def shard_positions(
    seq_len: int, rank: int, world_size: int, sharding: str = "zigzag", device=None
) -> torch.Tensor:
    """Global token positions (LongTensor, length seq_len/N) of ``rank``'s shard, in shard order.

    Use it for position-dependent inputs such as RoPE: the token at local index j sits at global
    position ``shard_positions(...)[j]``.
    """
    check_seq_len(seq_len, world_size, sharding)
    chunk = seq_len // num_chunks(world_size, sharding)
    return torch.cat(
        [
            torch.arange(c * chunk, (c + 1) * chunk, device=device)
            for c in shard_chunk_ids(rank, world_size, sharding)
        ]
    )


def shard_indices(
    seq_len: int, world_size: int, sharding: str = "zigzag", device=None
) -> torch.Tensor:
    """Global positions of the rank-ordered concatenation of all shards (what an all-gather yields).

    ``full.index_select(dim, shard_indices(...))`` lays out every rank's shard back to back;
    :func:`unshard_indices` is its inverse permutation.
    """
    return torch.cat(
        [shard_positions(seq_len, r, world_size, sharding, device) for r in range(world_size)]
    )


def unshard_indices(
    seq_len: int, world_size: int, sharding: str = "zigzag", device=None
) -> torch.Tensor:
    """Permutation that puts the rank-ordered concatenation of shards back in natural token order."""
    return torch.argsort(shard_indices(seq_len, world_size, sharding, device))


def group_chunk_plan(
    member_ranks: list[int], world_size: int, sharding: str
) -> list[tuple[int, int, int]]:
    """How the shards of ``member_ranks`` (CP ranks of a Ulysses group) interleave into token order.

    Returns ``(member, slot, dest)`` triples: chunk ``slot`` of member ``member``'s shard is chunk
    ``dest`` of the members' tokens laid out in ascending position. For the whole CP group this
    is natural order; for a hybrid Ulysses group of U consecutive ranks rU..rU+U-1 it is exactly
    ring rank r's shard of a ring of N/U ranks under the same sharding (chunks U times longer).
    """
    owned = [
        (chunk, member, slot)
        for member, rank in enumerate(member_ranks)
        for slot, chunk in enumerate(shard_chunk_ids(rank, world_size, sharding))
    ]
    return [(member, slot, dest) for dest, (_, member, slot) in enumerate(sorted(owned))]


def shard_for_rank(
    x: torch.Tensor, rank: int, world_size: int, dim: int = 2, sharding: str = "zigzag"
) -> torch.Tensor:
    """``rank``'s shard of the full tensor ``x`` along ``dim``, for code that has no process group.

    Contiguous shards are views of ``x``; zigzag shards are new tensors (two chunks joined).
    """
    seq_len = x.size(dim)
    check_seq_len(seq_len, world_size, sharding)
    chunk = seq_len // num_chunks(world_size, sharding)
    pieces = [x.narrow(dim, c * chunk, chunk) for c in shard_chunk_ids(rank, world_size, sharding)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_from_shards(
    shards: list[torch.Tensor], dim: int = 2, sharding: str = "zigzag"
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard (index = rank), in natural token order."""
    check_sharding(sharding)
    gathered = torch.cat(shards, dim=dim)
    if sharding == "contiguous":
        return gathered
    order = unshard_indices(gathered.size(dim), len(shards), sharding, gathered.device)
    return gathered.index_select(dim, order)


def shard_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 2, sharding: str = "zigzag"
) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` over ``group`` (None: default group).

    Every rank passes the same full tensor; nothing is communicated. The result is what the
    attention functions of this package expect as their local input.
    """
    return shard_for_rank(x, dist.get_rank(group), dist.get_world_size(group), dim, sharding)


def unshard_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 2, sharding: str = "zigzag"
) -> torch.Tensor:
    """All-gather every rank's shard along ``dim`` and return the full tensor in natural order.

    Not differentiable (it is meant for outputs, checks and logging).
    """
    check_sharding(sharding)
    world_size = dist.get_world_size(group)
    # gloo refuses non-contiguous buffers.
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(shards, x, group=group)
    return unshard_from_shards(shards, dim, sharding)
