"""The DP x CP mesh and the attention it implies, applied to a built model.

Rank order (innermost first): CP, then DP, so a CP group is consecutive ranks (inside a node
where it fits), and inside the CP group the Ulysses index is innermost:
    rank = dp_index * cp + cp_index,   cp_index = ring_index * ulysses + ulysses_index.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch.distributed as dist

from .. import cp as cp_attention
from .model import AttentionFn, Checkpointing, Transformer


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    dp: int
    cp: int
    ulysses: int
    layout: str
    cp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses


def build_context(*, rank: int, world_size: int, dp: int, cp: int, ulysses: int,
                  layout: str) -> ParallelContext:
    """Create the process groups. Every rank creates every group in the same order
    (`new_group` is collective over the whole job) and keeps the ones it belongs to."""
    if dp * cp != world_size:
        raise ValueError(f"dp x cp = {dp} x {cp} must equal the world size {world_size}")
    if cp % ulysses:
        raise ValueError(f"the Ulysses degree {ulysses} must divide cp = {cp}")
    ring = cp // ulysses
    mine: dict[str, dist.ProcessGroup | None] = dict.fromkeys(("cp", "dp", "ulysses", "ring"))

    def make(name: str, ranks: list[int]) -> None:
        if world_size == 1 or len(ranks) == 1:
            return
        group = dist.new_group(ranks)
        if rank in ranks:
            mine[name] = group

    for d in range(dp):
        make("cp", [d * cp + c for c in range(cp)])
    for c in range(cp):
        make("dp", [d * cp + c for d in range(dp)])
    if 1 < ulysses < cp:
        for d in range(dp):
            for r in range(ring):
                make("ulysses", [d * cp + r * ulysses + u for u in range(ulysses)])
            for u in range(ulysses):
                make("ring", [d * cp + r * ulysses + u for r in range(ring)])
    return ParallelContext(rank=rank, world_size=world_size, dp=dp, cp=cp, ulysses=ulysses,
                           layout=layout, cp_group=mine["cp"], dp_group=mine["dp"],
                           ulysses_group=mine["ulysses"], ring_group=mine["ring"])


def attention_for(ctx: ParallelContext, algorithm: str) -> AttentionFn:
    """The attention the layout calls for, bound to this rank's groups."""
    if ctx.cp == 1:
        return partial(cp_attention.full_attention, causal=True)
    if algorithm == "ring" or (algorithm == "hybrid" and ctx.ulysses == 1):
        return partial(cp_attention.ring_attention, group=ctx.cp_group, causal=True,
                       layout=ctx.layout)
    if algorithm == "ulysses" or (algorithm == "hybrid" and ctx.ulysses == ctx.cp):
        return partial(cp_attention.ulysses_attention, group=ctx.cp_group, causal=True,
                       layout=ctx.layout)
    if algorithm == "hybrid":
        return partial(cp_attention.hybrid_attention, ulysses_group=ctx.ulysses_group,
                       ring_group=ctx.ring_group, causal=True, layout=ctx.layout)
    raise ValueError(f"unknown CP algorithm {algorithm!r}")


def parallelize(model: Transformer, *, ctx: ParallelContext, algorithm: str,
                checkpointing: Checkpointing) -> None:
    """Install the layout's attention in every block and set activation checkpointing."""
    attend = attention_for(ctx, algorithm)
    for block in model.blocks:
        block.attn.attend = attend
    model.set_checkpointing(checkpointing)
