"""A rank's place in the layout: the job's `ParallelDims` and the process groups built from it
(the mesh), and the attention its CP group runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch.distributed as dist

from ctxlaunch import cp as cp_attention
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.cp import comm as cp_comm
from ctxlaunch.runtime.modeling.model import AttentionFn


@dataclass(frozen=True)
class ParallelContext:
    """This rank, the job's degrees, and the process groups this rank belongs to."""

    rank: int
    dims: ParallelDims
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """Role (contract.parallel_dims.GROUPS) -> this rank's group; a role is absent where the
    group would hold this rank alone."""

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp_rank(self) -> int:
        return self.dims.coordinates(self.rank).tp_rank

    @property
    def cp_rank(self) -> int:
        return self.dims.coordinates(self.rank).cp_rank

    @property
    def dp_rank(self) -> int:
        return self.dims.coordinates(self.rank).dp_rank

    @property
    def pp_rank(self) -> int:
        return self.dims.coordinates(self.rank).pp_rank

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("tp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("cp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("pp")

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group (which experts it holds)."""
        return self.dims.coordinates(self.rank).ep_rank

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks exchanging tokens for one set of all experts (ep > 1)."""
        return self.groups.get("ep")

    @property
    def edp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts: expert gradients average and FSDP2 shards expert
        states here (None where this rank alone holds its experts)."""
        if self.dims.ep == 1:
            return self.dp_cp_group
        return self.groups.get("edp")

    @property
    def tokens_group(self) -> dist.ProcessGroup | None:
        """Every rank holding a part of the micro-batch's tokens (DP x CP x TP of this pipeline
        stage; None: the whole job, where there is one stage)."""
        return self.groups.get("tokens")

    @property
    def ulysses_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("ulysses")

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("ring")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same weights (same TP and PP index): gradients average and
        FSDP2 shards here."""
        if "dp_cp" in self.groups:
            return self.groups["dp_cp"]
        return self.cp_group if self.dims.dp == 1 else self.dp_group


def build_context(dims: ParallelDims, *, rank: int) -> ParallelContext:
    """Create the process groups of `dims` (the launcher started dims.world_size ranks). Every
    rank creates every group in the same order (`new_group` is collective over the whole job)
    and keeps the ones it belongs to."""
    mine: dict[str, dist.ProcessGroup] = {}
    if dims.world_size > 1:
        for role, ranks in dims.group_ranks():
            group = cp_comm.new_group(ranks)
            if rank in ranks:
                mine[role] = group
    return ParallelContext(rank=rank, dims=dims, groups=mine)


def attention_for(ctx: ParallelContext, tile_tokens: int | None = None) -> AttentionFn:
    """The attention the layout calls for, bound to this rank's groups (a ring's backward
    over tiles of `tile_tokens`, training.attention_tile_tokens)."""
    d = ctx.dims
    if d.cp == 1:
        return partial(cp_attention.full_attention, causal=True)
    algorithm = d.cp_algorithm
    if algorithm == "ring" or (algorithm == "hybrid" and d.ulysses_degree == 1):
        return partial(
            cp_attention.ring_attention,
            group=ctx.cp_group,
            causal=True,
            sharding=d.cp_sharding,
            tile_tokens=tile_tokens,
        )
    if algorithm == "ulysses" or (algorithm == "hybrid" and d.ulysses_degree == d.cp):
        return partial(
            cp_attention.ulysses_attention,
            group=ctx.cp_group,
            causal=True,
            sharding=d.cp_sharding,
        )
    if algorithm == "hybrid":
        assert ctx.ulysses_group is not None and ctx.ring_group is not None  # 1 < ulysses < cp
        return partial(
            cp_attention.hybrid_attention,
            ulysses_group=ctx.ulysses_group,
            ring_group=ctx.ring_group,
            causal=True,
            sharding=d.cp_sharding,
            tile_tokens=tile_tokens,
        )
    raise ValueError(f"unknown CP algorithm {algorithm!r}")
