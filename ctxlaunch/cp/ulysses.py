# Shapes: q (B, Hq, S/N, D), k, v (B, Hkv, S/N, D) local shards <-> (B, H/N, S, D) head shards; lse (B, Hq, S/N) fp32.
"""DeepSpeed-Ulysses attention: an all-to-all turns sequence shards into head shards of the full
sequence, ordinary attention runs on H/N heads, and a second all-to-all turns the result back.

The all-to-all here also puts the gathered tokens in ascending position order (shards arrive in
rank order, which under zigzag is not token order), so causal attention needs no special mask.
Under the balanced sharding a batch element's members hold runs that its document boundaries
decide: the tokens are put in order by one index per batch group instead of chunk by chunk.
A local layer's window, soft-capped scores and attention sinks apply after the all-to-all, to
the whole sequence of this rank's heads (each rank holds the sinks of the heads it gets).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import kernels
from .comm import exposed
from .documents import CuSeqlens, batch_groups, check_documents
from .reference import check_extensions, full_attention
from .sharding import check_shard_len, group_chunk_plan, rank_spans


class HeadShardPlan:
    """Where each chunk of each group member's shard goes in the gathered head shard.

    ``member_ranks`` are the CP ranks of the group's members in group-rank order, out of a CP
    group of ``cp_world_size`` ranks (the Ulysses group itself, or one inner group of a hybrid).
    ``documents`` place the balanced sharding's tokens (the other shardings ignore them).
    """

    def __init__(
        self,
        group,
        member_ranks: list[int],
        cp_world_size: int,
        sharding: str,
        s_local: int,
        documents: CuSeqlens | None = None,
    ):
        self.group = group
        self.size = len(member_ranks)
        self.chunks = group_chunk_plan(member_ranks, cp_world_size, sharding)
        self.chunk_len = s_local * self.size // len(self.chunks)
        # Balanced: per batch group, the flattened (member, local row) of each gathered row.
        self.orders: list[tuple[slice, list[int]]] | None = None
        if sharding == "balanced" and documents is not None:
            self.orders = [
                (batch, _gather_order(bounds, member_ranks, cp_world_size, s_local))
                for batch, bounds in batch_groups(documents)
            ]

    def copy_chunks(
        self, gathered: torch.Tensor, per_member: torch.Tensor, to_gathered: bool
    ) -> None:
        """Copy between ``per_member`` (n, B, h, s, D) and ``gathered`` (B, h, n*s, D) chunk by chunk;
        narrow copies move the data once, where index_select after a permute would move it twice."""
        if self.orders is not None:
            self._copy_ordered(gathered, per_member, to_gathered)
            return
        c = self.chunk_len
        for member, slot, dest in self.chunks:
            member_chunk = per_member[member].narrow(2, slot * c, c)
            gathered_chunk = gathered.narrow(2, dest * c, c)
            if to_gathered:
                gathered_chunk.copy_(member_chunk)
            else:
                member_chunk.copy_(gathered_chunk)

    def _copy_ordered(
        self, gathered: torch.Tensor, per_member: torch.Tensor, to_gathered: bool
    ) -> None:
        """The balanced sharding's copy: its runs are many and differ per batch group, so each
        group moves through one index (two passes over the data, not one copy per run)."""
        assert self.orders is not None
        n, _, h, s, d = per_member.shape
        for batch, order in self.orders:
            index = torch.tensor(order, device=gathered.device)
            if to_gathered:
                flat = per_member[:, batch].permute(1, 2, 0, 3, 4).reshape(-1, h, n * s, d)
                torch.index_select(flat, 2, index, out=gathered[batch])
            else:
                flat = gathered[batch].index_select(2, torch.argsort(index))
                per_member[:, batch].copy_(flat.unflatten(2, (n, s)).permute(2, 0, 1, 3, 4))


def _gather_order(
    bounds: tuple[int, ...], member_ranks: list[int], cp_world_size: int, s_local: int
) -> list[int]:
    """For each of the members' tokens in ascending position, its row in the members' shards
    laid end to end (member m's local row j is m * s_local + j)."""
    located = []
    for m, rank in enumerate(member_ranks):
        local = 0
        for start, length in rank_spans(bounds, rank, cp_world_size, "balanced"):
            located.append((start, m * s_local + local, length))
            local += length
    return [row + i for _, row, length in sorted(located) for i in range(length)]


def _seq_to_heads(xs: list[torch.Tensor], plan: HeadShardPlan) -> list[torch.Tensor]:
    """(B, H_i, s, D) sequence shards -> (B, H_i/n, n*s, D) head shards, tokens in ascending order.

    All tensors (q, k, v, whatever their head counts) travel in one all-to-all.
    """
    n = plan.size
    heads = [x.size(1) // n for x in xs]
    # Member j gets head group j of every tensor; all_to_all_single splits dim 0.
    send = torch.cat(
        [x.unflatten(1, (n, h)).movedim(1, 0) for x, h in zip(xs, heads, strict=True)], dim=2
    )
    recv = torch.empty_like(send)
    with exposed():  # blocking: nothing overlaps an all-to-all here
        dist.all_to_all_single(recv, send, group=plan.group)
    gathered = []
    for part in recv.split(heads, dim=2):
        _, b, h, s, d = part.shape
        gathered.append(part.new_empty(b, h, n * s, d))
        plan.copy_chunks(gathered[-1], part, to_gathered=True)
    return gathered


def _heads_to_seq(ys: list[torch.Tensor], plan: HeadShardPlan) -> list[torch.Tensor]:
    """(B, H_i/n, n*s, D) head shards in ascending token order -> (B, H_i, s, D) sequence shards."""
    n = plan.size
    heads = [y.size(1) for y in ys]
    b, _, seq, d = ys[0].shape
    send = ys[0].new_empty(n, b, sum(heads), seq // n, d)
    for y, part in zip(ys, send.split(heads, dim=2), strict=True):
        plan.copy_chunks(y, part, to_gathered=False)
    recv = torch.empty_like(send)
    with exposed():  # blocking: nothing overlaps an all-to-all here
        dist.all_to_all_single(recv, send, group=plan.group)
    return [part.movedim(0, 1).flatten(1, 2) for part in recv.split(heads, dim=2)]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, *xs):
        ctx.plan = plan
        return tuple(_seq_to_heads(list(xs), plan))

    @staticmethod
    def backward(ctx, *grads):
        return None, *_heads_to_seq(list(grads), ctx.plan)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, *ys):
        ctx.plan = plan
        return tuple(_heads_to_seq(list(ys), plan))

    @staticmethod
    def backward(ctx, *grads):
        return None, *_seq_to_heads(list(grads), ctx.plan)


def check_head_split(q: torch.Tensor, k: torch.Tensor, degree: int, what: str) -> None:
    """Raise ValueError unless query and K/V heads split evenly over ``degree`` ranks."""
    if q.size(1) % degree != 0:
        raise ValueError(
            f"{what}: query heads ({q.size(1)}) must be divisible by the Ulysses degree ({degree})"
        )
    if k.size(1) % degree != 0:
        raise ValueError(
            f"{what}: key/value heads ({k.size(1)}) must be divisible by the Ulysses degree "
            f"({degree}); with fewer K/V heads use hybrid_attention (Ulysses x ring) with a "
            f"Ulysses degree that divides {k.size(1)}"
        )


def member_sinks(sinks: torch.Tensor | None, plan: HeadShardPlan) -> torch.Tensor | None:
    """The sinks of the heads this member gets from the all-to-all (head group j for group
    rank j); a differentiable slice, so their gradient reaches the whole parameter."""
    if sinks is None:
        return None
    heads = sinks.size(0) // plan.size
    return sinks.narrow(0, dist.get_rank(plan.group) * heads, heads)


def head_sharded_attention(q, k, v, plan: HeadShardPlan, attend, return_lse: bool):
    """All-to-all q, k, v to head shards, run ``attend(q, k, v) -> (out, lse)`` on them, and
    all-to-all the output (and lse) back. Shared by Ulysses and hybrid attention."""
    out, lse = attend(*_SeqToHeads.apply(plan, q, k, v))
    (out,) = _HeadsToSeq.apply(plan, out)
    if not return_lse:
        return out
    return out, _heads_to_seq([lse.unsqueeze(-1)], plan)[0].squeeze(-1)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    sharding: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
    documents: Sequence[Sequence[int]] | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Ulysses (all-to-all) attention over the ranks of ``group`` (None: default group); differentiable.

    Each rank passes its shards of q (B, Hq, S/N, D) and k, v (B, Hkv, S/N, D), as
    ``shard_sequence(x, group, dim=2, sharding=sharding)`` cuts them, and gets its output shard.
    ``group`` is the whole CP group; ``sharding`` must be the one the shards were cut with. Needs
    Hq % N == 0 and Hkv % N == 0 (K/V heads are sent as they are; for fewer K/V heads than N use
    ``hybrid_attention``). With ``return_lse`` also returns the fp32 lse (B, Hq, S/N).
    ``documents`` (the global document boundaries per batch element, as ``ring_attention``
    takes them): after the all-to-all each rank holds the whole sequence in token order for
    its heads, so each document is plain causal attention on its rows. Under
    ``sharding="balanced"`` the shards must have been cut with the same ``documents``.
    ``window``, ``softcap`` and ``sinks`` (Hq,) as ``ring_attention`` takes them, applied after
    the all-to-all.
    """
    kernels.check_qkv(q, k, v)
    world_size = dist.get_world_size(group)
    check_shard_len(q.size(2), k.size(2), world_size, sharding)
    check_head_split(q, k, world_size, "ulysses_attention")
    check_extensions(causal, window, softcap, sinks, q.size(1))
    scale = kernels.resolve_scale(q, scale)
    cu = check_documents(documents, causal, q.size(0), q.size(2) * world_size)
    plan = HeadShardPlan(group, list(range(world_size)), world_size, sharding, q.size(2), cu)
    local_sinks = member_sinks(sinks, plan)

    def attend(qh, kh, vh):
        return full_attention(
            qh, kh, vh, causal, scale, return_lse=True, documents=cu, window=window,
            softcap=softcap, sinks=local_sinks,
        )  # fmt: skip

    return head_sharded_attention(q, k, v, plan, attend, return_lse)
