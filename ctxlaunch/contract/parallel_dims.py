"""The parallel degrees of a job: the one record the planner, the advisor, the healing re-plan
and the trainer all read (as torchtitan's ParallelDims), derived once from the spec's parallel
and cluster sections.

Rank order (innermost first): TP, CP, DP, PP. TP (a collective in every block, forward and
backward, on the critical path) is consecutive ranks, inside a node; a CP group spans tp x cp
consecutive ranks, inside a node (or an NVLink domain) where it fits; DP reduces gradients once
a step and PP sends one activation per micro-batch and stage, the two that tolerate the slowest
links, go outermost. Inside the CP group the Ulysses index is innermost:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index,
    cp_index = ring_index * ulysses_degree + ulysses_index.

Expert parallelism is folded over DP x CP (torchtitan's and Megatron's "MoE parallel folding"):
it takes no ranks of its own. The ranks of one TP and PP index that hold the same dense weights
(the shard group, dp x cp of them, in the order dp_index * cp + cp_index) are cut into groups of
ep consecutive ranks; each such EP group holds every expert once, E / ep on each rank, and
exchanges tokens by all-to-all. The ranks of the shard group at the same place of their EP group
hold the same experts (the expert-data-parallel group, dp x cp / ep of them): expert gradients
are reduced, and FSDP2 shards expert states, over it. With ep <= cp an EP group lies inside one
CP group; the attention layout never changes with ep.

`group_ranks` lists every process group of that order (what the trainer creates, in the order
every rank must create them); the trainer's context holds these degrees and the groups built
from them, nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ctxlaunch.contract.spec.cluster_section import ClusterSpec
    from ctxlaunch.contract.spec.parallel_section import ParallelSpec

CpAlgorithm = Literal["ring", "ulysses", "hybrid", "allgather"]
"""How the CP group computes attention: the spec's ring, ulysses and hybrid, or "allgather" (K/V
all-gathered before attention and dK/dV reduce-scattered after it, as Llama 3 ran CP,
arXiv:2407.21783 section 3.3.2), which the planner times for published runs and no spec sets."""

GROUPS = ("tp", "cp", "dp", "dp_cp", "ulysses", "ring", "ep", "edp", "tokens", "pp")
"""The process groups a rank may belong to, by role (see `ParallelDims.group_ranks`)."""


@dataclass(frozen=True)
class Coordinates:
    """A rank's index along each degree: its rank in its TP, CP, DP and PP groups."""

    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int = 0
    """Its place in its EP group: it holds experts [ep_rank * E / ep, (ep_rank + 1) * E / ep)."""


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel degree of a job, and how the sequence is split over its CP ranks."""

    tp: int = 1
    """Tensor parallel degree."""
    pp: int = 1
    """Pipeline parallel degree (PP ranks, not stages: see virtual_stages)."""
    cp: int = 1
    """Context parallel degree: ulysses_degree x ring_degree."""
    ep: int = 1
    """Expert parallel degree, folded over DP x CP (it divides dp x cp): the experts of a
    mixture-of-experts layer are split over ep ranks of the shard group."""
    dp: int = 1
    """Data parallel degree."""
    cp_algorithm: str = "ring"
    """How the CP group computes attention (`CpAlgorithm`)."""
    ulysses_degree: int = 1
    """The Ulysses (inner, all-to-all) degree of the CP group: cp under ulysses, the spec's
    under hybrid, 1 under ring."""
    cp_sharding: str = "zigzag"
    """How the sequence is split over the CP ranks (spec `parallel.cp_sharding`)."""
    virtual_stages: int = 1
    """Pipeline stages per PP rank (interleaved 1F1B above 1)."""

    @classmethod
    def from_sections(cls, parallel: ParallelSpec, cluster: ClusterSpec) -> ParallelDims:
        """The degrees the `parallel` section sets on the GPUs of the `cluster` section. dp,
        when not given, is the GPU count over tp x pp x cp, rounded down (ep borrows its ranks
        from dp x cp): where that does not fill the GPUs, `world_size` differs from the
        cluster's (the spec's rules say so)."""
        p = parallel
        if p.cp_algorithm == "ulysses":
            ulysses = p.cp
        elif p.cp_algorithm == "hybrid":
            ulysses = p.ulysses_degree or 1
        else:
            ulysses = 1
        per_replica = p.tp * p.pp * p.cp
        return cls(
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            dp=p.dp if p.dp is not None else max(cluster.world_size // per_replica, 1),
            cp_algorithm=p.cp_algorithm,
            ulysses_degree=ulysses,
            cp_sharding=p.cp_sharding,
            virtual_stages=p.virtual_stages,
        )

    def replace(self, **changes: Any) -> ParallelDims:
        """These degrees with some changed."""
        return dataclasses.replace(self, **changes)

    @property
    def ring_degree(self) -> int:
        """The ring (outer) degree of the CP group: cp // ulysses_degree."""
        return self.cp // self.ulysses_degree

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one data-parallel replica: tp x pp x cp (ep is folded over dp x cp)."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        """Ranks of the job: tp x pp x cp x dp."""
        return self.ranks_per_replica * self.dp

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp x virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def shard_group(self) -> int:
        """Ranks that ZeRO and FSDP shard model states over: DP x CP (the ranks that hold the
        same weights)."""
        return self.dp * self.cp

    @property
    def expert_shard_group(self) -> int:
        """Ranks that hold the same experts (the expert-data-parallel group): dp x cp / ep.
        Expert gradients are reduced, and FSDP2 shards expert states, over these."""
        return max(self.shard_group // self.ep, 1)

    def describe(self) -> str:
        """How the GPUs are split, in one phrase: "tp 8 pp 1 cp 4 hybrid u2 dp 2"."""
        algo = (
            ""
            if self.cp == 1
            else f" {self.cp_algorithm}"
            + (f" u{self.ulysses_degree}" if self.cp_algorithm == "hybrid" else "")
        )
        experts = f" ep {self.ep}" if self.ep > 1 else ""
        return f"tp {self.tp} pp {self.pp} cp {self.cp}{algo} dp {self.dp}{experts}"

    # -- the ranks ----------------------------------------------------------------------------
    def rank_of(self, *, tp: int, cp: int, dp: int, pp: int) -> int:
        """The rank at these indices (the rank order of the module docstring)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coordinates(self, rank: int) -> Coordinates:
        """`rank`'s index along each degree."""
        cp_rank = rank // self.tp % self.cp
        dp_rank = rank // (self.tp * self.cp) % self.dp
        return Coordinates(
            tp_rank=rank % self.tp,
            cp_rank=cp_rank,
            dp_rank=dp_rank,
            pp_rank=rank // (self.tp * self.cp * self.dp),
            ep_rank=(dp_rank * self.cp + cp_rank) % self.ep,
        )

    def group_ranks(self) -> list[tuple[str, list[int]]]:
        """Every process group of the layout as (role, its ranks), in the one order every rank
        creates them (group creation is collective over the whole job). Roles: tp; cp; dp;
        dp_cp, the ranks holding the same weights (where both dp and cp exceed 1); ulysses and
        ring, the two parts of a hybrid CP group; ep, ep consecutive ranks of the shard group,
        which exchange tokens and hold every expert once, and edp, the ranks of the shard group
        holding the same experts (both where ep > 1); tokens, every rank of one pipeline stage
        (each holds a part of the step's tokens: the router statistics are summed over it),
        where pp > 1 (with one stage the whole job is that group); pp. Groups of one rank are
        left out."""
        tp, cp, dp, pp = self.tp, self.cp, self.dp, self.pp
        ulysses, ring = self.ulysses_degree, self.ring_degree
        at = self.rank_of
        groups: list[tuple[str, list[int]]] = []
        for p in range(pp):
            for d in range(dp):
                for c in range(cp):
                    groups.append(("tp", [at(tp=t, cp=c, dp=d, pp=p) for t in range(tp)]))
        for p in range(pp):
            for t in range(tp):
                for d in range(dp):
                    groups.append(("cp", [at(tp=t, cp=c, dp=d, pp=p) for c in range(cp)]))
                for c in range(cp):
                    groups.append(("dp", [at(tp=t, cp=c, dp=d, pp=p) for d in range(dp)]))
                if dp > 1 and cp > 1:
                    group = [at(tp=t, cp=c, dp=d, pp=p) for d in range(dp) for c in range(cp)]
                    groups.append(("dp_cp", group))
                if 1 < ulysses < cp:
                    for d in range(dp):
                        for r in range(ring):
                            group = [
                                at(tp=t, cp=r * ulysses + u, dp=d, pp=p) for u in range(ulysses)
                            ]
                            groups.append(("ulysses", group))
                        for u in range(ulysses):
                            group = [at(tp=t, cp=r * ulysses + u, dp=d, pp=p) for r in range(ring)]
                            groups.append(("ring", group))
                if self.ep > 1:
                    shard = [at(tp=t, cp=c, dp=d, pp=p) for d in range(dp) for c in range(cp)]
                    for start in range(0, len(shard), self.ep):
                        groups.append(("ep", shard[start : start + self.ep]))
                    for index in range(self.ep):
                        groups.append(("edp", shard[index :: self.ep]))
        if pp > 1:
            per_stage = tp * cp * dp
            for p in range(pp):
                groups.append(("tokens", list(range(p * per_stage, (p + 1) * per_stage))))
        for t in range(tp):
            for d in range(dp):
                for c in range(cp):
                    groups.append(("pp", [at(tp=t, cp=c, dp=d, pp=p) for p in range(pp)]))
        return [(role, ranks) for role, ranks in groups if len(ranks) > 1]
