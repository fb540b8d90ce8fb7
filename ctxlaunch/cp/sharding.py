# Shapes: full x (B, ..., S, ...) with S = global length at `dim`; shard (B, ..., S/N, ...); N = CP size.
"""Which tokens each context-parallel rank holds, and moving tensors between full and sharded.

Three shardings:

- ``"zigzag"``: the sequence is cut into 2N equal chunks; rank i holds chunks i and 2N-1-i,
  concatenated in that order. Under a causal mask every rank then does the same work.
- ``"contiguous"``: the sequence is cut into N equal chunks; rank i holds chunk i.
- ``"balanced"``: for a packed, document-masked sequence, the tokens `balance.balanced_spans`
  places so that every rank computes the same attention area under the mask; it depends on
  the document boundaries (``documents``, one tuple per batch element), so each batch element
  has its own. Without documents (an unmasked sequence, or one document) it is zigzag.

A rank's shard always lists its tokens in ascending position. The index helpers are pure (no
process group). ``shard_sequence`` needs no communication either; ``unshard_sequence``
all-gathers. The helpers that take ``documents`` treat dim 0 as the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .balance import Span, balanced_spans

SHARDINGS = ("zigzag", "contiguous", "balanced")


def check_sharding(sharding: str) -> None:
    """Raise ValueError unless ``sharding`` is one of :data:`SHARDINGS`."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is not supported; choose one of {SHARDINGS}")


def num_chunks(world_size: int, sharding: str) -> int:
    """How many equal chunks the sequence is cut into: 2N for zigzag (and balanced, which is
    zigzag without documents and needs the same divisibility), N for contiguous."""
    check_sharding(sharding)
    return world_size if sharding == "contiguous" else 2 * world_size


def check_seq_len(seq_len: int, world_size: int, sharding: str) -> None:
    """Raise ValueError unless a sequence of ``seq_len`` tokens splits evenly under ``sharding``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    chunks = num_chunks(world_size, sharding)
    if seq_len % chunks != 0:
        rule = "N" if sharding == "contiguous" else "2*N"
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
    """Chunk ids (out of :func:`num_chunks`) that ``rank`` holds, in the order it stores them
    (balanced without documents: zigzag's)."""
    check_sharding(sharding)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if sharding == "contiguous":
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def rank_spans(
    bounds: tuple[int, ...] | None, rank: int, world_size: int, sharding: str
) -> tuple[Span, ...]:
    """The runs ``rank`` holds of one sequence, (global start, length) in its local order
    (ascending). ``bounds`` (the sequence's document boundaries, 0 to S) matter only to the
    balanced sharding; None or a single document gives zigzag's chunks."""
    if sharding == "balanced" and bounds is not None:
        check_seq_len(bounds[-1], world_size, sharding)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        return balanced_spans(tuple(bounds), world_size)[rank]
    if bounds is None:
        raise ValueError("rank_spans needs the sequence's boundaries (at least (0, S))")
    seq_len = bounds[-1]
    check_seq_len(seq_len, world_size, sharding)
    chunk = seq_len // num_chunks(world_size, sharding)
    return tuple((c * chunk, chunk) for c in shard_chunk_ids(rank, world_size, sharding))


def _positions_of(spans: Sequence[Span], device=None) -> torch.Tensor:
    return torch.cat([torch.arange(start, start + n, device=device) for start, n in spans])


def _documents_matter(sharding: str, documents: Sequence[Sequence[int]] | None) -> bool:
    return sharding == "balanced" and documents is not None


def shard_positions(
    seq_len: int,
    rank: int,
    world_size: int,
    sharding: str = "zigzag",
    device=None,
    documents: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Global token positions (LongTensor, length seq_len/N) of ``rank``'s shard, in shard order.

    Use it for position-dependent inputs such as RoPE: the token at local index j sits at global
    position ``shard_positions(...)[j]``. Under the balanced sharding with ``documents`` (one
    boundary tuple per batch element) the positions differ per batch element: (B, seq_len/N).
    """
    check_seq_len(seq_len, world_size, sharding)
    if _documents_matter(sharding, documents):
        assert documents is not None
        return torch.stack(
            [
                _positions_of(rank_spans(tuple(bounds), rank, world_size, sharding), device)
                for bounds in documents
            ]
        )
    chunk = seq_len // num_chunks(world_size, sharding)
    return torch.cat(
        [
            torch.arange(c * chunk, (c + 1) * chunk, device=device)
            for c in shard_chunk_ids(rank, world_size, sharding)
        ]
    )


def shard_indices(
    seq_len: int,
    world_size: int,
    sharding: str = "zigzag",
    device=None,
    documents: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Global positions of the rank-ordered concatenation of all shards (what an all-gather yields).

    ``full.index_select(dim, shard_indices(...))`` lays out every rank's shard back to back;
    :func:`unshard_indices` is its inverse permutation. (B, seq_len) under the balanced
    sharding with ``documents``.
    """
    return torch.cat(
        [
            shard_positions(seq_len, r, world_size, sharding, device, documents)
            for r in range(world_size)
        ],
        dim=-1,
    )


def unshard_indices(
    seq_len: int,
    world_size: int,
    sharding: str = "zigzag",
    device=None,
    documents: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Permutation that puts the rank-ordered concatenation of shards back in natural token order."""
    return torch.argsort(shard_indices(seq_len, world_size, sharding, device, documents), dim=-1)


def _take(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x`` along ``dim`` at ``index``: the same for every batch element (1-D index), or
    index[b] for batch element b (dim 0 is the batch)."""
    if index.dim() == 1:
        return x.index_select(dim, index)
    return torch.stack([x[b].index_select(dim - 1, index[b]) for b in range(x.size(0))])


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
    x: torch.Tensor,
    rank: int,
    world_size: int,
    dim: int = 2,
    sharding: str = "zigzag",
    documents: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """``rank``'s shard of the full tensor ``x`` along ``dim``, for code that has no process group.

    Contiguous shards are views of ``x``; zigzag shards are new tensors (two chunks joined).
    ``documents`` (one boundary tuple per batch element, dim 0 the batch) place the balanced
    sharding's tokens; the other shardings ignore them.
    """
    seq_len = x.size(dim)
    check_seq_len(seq_len, world_size, sharding)
    if _documents_matter(sharding, documents):
        positions = shard_positions(seq_len, rank, world_size, sharding, x.device, documents)
        return _take(x, dim % x.dim(), positions)
    chunk = seq_len // num_chunks(world_size, sharding)
    pieces = [x.narrow(dim, c * chunk, chunk) for c in shard_chunk_ids(rank, world_size, sharding)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_from_shards(
    shards: list[torch.Tensor],
    dim: int = 2,
    sharding: str = "zigzag",
    documents: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard (index = rank), in natural token order."""
    check_sharding(sharding)
    gathered = torch.cat(shards, dim=dim)
    if sharding == "contiguous":
        return gathered
    order = unshard_indices(gathered.size(dim), len(shards), sharding, gathered.device, documents)
    return _take(gathered, dim % gathered.dim(), order)


def shard_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 2,
    sharding: str = "zigzag",
    documents: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` over ``group`` (None: default group).

    Every rank passes the same full tensor; nothing is communicated. The result is what the
    attention functions of this package expect as their local input. Under the balanced
    sharding pass the same ``documents`` the attention gets.
    """
    return shard_for_rank(
        x, dist.get_rank(group), dist.get_world_size(group), dim, sharding, documents
    )


def unshard_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 2,
    sharding: str = "zigzag",
    documents: Sequence[Sequence[int]] | None = None,
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
    return unshard_from_shards(shards, dim, sharding, documents)
