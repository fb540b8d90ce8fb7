# Shapes: q (B, Hq, S/N, D), k, v (B, Hkv, S/N, D) local shards, N = U*R; inside (B, H/U, S/R, D); lse (B, Hq, S/N) fp32
"""Hybrid (USP) attention: Ulysses all-to-all inside groups of U consecutive CP ranks, ring
attention across the R = N/U groups.

Why it composes with no extra bookkeeping: with shards cut by ``shard_sequence`` over all N CP
ranks, the tokens that Ulysses group r (CP ranks rU..rU+U-1) gathers are, in ascending order,
exactly ring rank r's shard of a ring of R ranks under the same sharding with U-times longer
chunks (zigzag: chunks rU..rU+U-1 and (2R-1-r)U..(2R-r)U-1 of 2N, i.e. chunks r and 2R-1-r of
2R). So: all-to-all in the Ulysses group, ring over the ring group on the head shards, back.
The same holds for a document mask: the inner ring's shards are pieces of the same global
sequence, so the global document boundaries apply to it unchanged. Under the balanced sharding
a Ulysses group's tokens are the union of its members' runs, in ascending position: the inner
ring is told so (``RingShards`` with the Ulysses degree), and its blocks follow from the runs.
A local layer's window applies to both: after the all-to-all its inner ring exchanges only
the halos its queries see (``window.py``); soft-capped scores and sinks pass to the inner ring
on this rank's heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import comm, kernels
from .documents import RingShards, check_documents
from .reference import check_extensions, full_attention
from .ring import check_tile_tokens, ring_attention_on
from .sharding import check_shard_len
from .ulysses import HeadShardPlan, check_head_split, head_sharded_attention, member_sinks


def new_hybrid_groups(
    ulysses_size: int, group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create ``(ulysses_group, ring_group)`` for this rank from its CP ``group`` (None: default).

    CP rank c belongs to Ulysses group c // U (U consecutive CP ranks) and to ring group c % U.
    Every rank of ``group`` calls this; ranks outside it (other CP groups of a DP x CP job) need
    not, since each rank creates only its own two groups, synchronising with their members only.
    """
    cp_ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    world_size = len(cp_ranks)
    if ulysses_size < 1 or world_size % ulysses_size != 0:
        raise ValueError(f"ulysses_size={ulysses_size} must divide the CP group size {world_size}")
    me = dist.get_rank(group)
    first = me - me % ulysses_size
    ulysses_ranks = cp_ranks[first : first + ulysses_size]
    ring_ranks = cp_ranks[me % ulysses_size :: ulysses_size]
    # Every member creates its Ulysses group before its ring group, so the group-local
    # barriers cannot wait on each other in a cycle.
    ulysses_group = comm.new_group(ulysses_ranks, use_local_synchronization=True)
    ring_group = comm.new_group(ring_ranks, use_local_synchronization=True)
    return ulysses_group, ring_group


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
    causal: bool = True,
    sharding: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
    documents: Sequence[Sequence[int]] | None = None,
    tile_tokens: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Ulysses x ring attention; differentiable.

    Groups: with U = size(ulysses_group) and R = size(ring_group), the CP group has N = U*R ranks
    and this rank's CP rank is ``rank(ring_group) * U + rank(ulysses_group)``: each Ulysses group
    is U consecutive CP ranks, each ring group takes one rank from every Ulysses group (same
    Ulysses index). :func:`new_hybrid_groups` builds them. Each rank passes its shards of q
    (B, Hq, S/N, D) and k, v (B, Hkv, S/N, D) as ``shard_sequence`` over the whole CP group cuts
    them, and gets its output shard. Needs Hq % U == 0 and Hkv % U == 0 (the ring has no head
    constraint, which is how GQA with few K/V heads reaches degrees beyond Hkv).
    ``documents``: a document mask, the global boundaries as ``ring_attention`` takes them
    (under ``sharding="balanced"`` the shards must have been cut with the same ``documents``).
    ``tile_tokens``: the inner ring's backward over tiles (``ring_attention``'s).
    ``window``, ``softcap`` and ``sinks`` (Hq,) as ``ring_attention`` takes them.
    """
    kernels.check_qkv(q, k, v)
    ulysses_size, ring_size = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    cp_world_size = ulysses_size * ring_size
    check_shard_len(q.size(2), k.size(2), cp_world_size, sharding)
    check_head_split(q, k, ulysses_size, "hybrid_attention")
    scale = kernels.resolve_scale(q, scale)
    check_tile_tokens(tile_tokens)
    check_extensions(causal, window, softcap, sinks, q.size(1))
    cu = check_documents(documents, causal, q.size(0), q.size(2) * cp_world_size)
    first = dist.get_rank(ring_group) * ulysses_size
    members = list(range(first, first + ulysses_size))
    plan = HeadShardPlan(ulysses_group, members, cp_world_size, sharding, q.size(2), cu)
    shards = RingShards(sharding, ring_size, ulysses_size)
    local_sinks = member_sinks(sinks, plan)

    def attend(qh, kh, vh):
        if ring_size == 1:
            return full_attention(
                qh, kh, vh, causal, scale, return_lse=True, documents=cu, window=window,
                softcap=softcap, sinks=local_sinks,
            )  # fmt: skip
        return ring_attention_on(
            qh, kh, vh, ring_group, causal, shards, scale, True, cu, tile_tokens,
            window=window, softcap=softcap, sinks=local_sinks,
        )  # fmt: skip

    return head_sharded_attention(q, k, v, plan, attend, return_lse)
