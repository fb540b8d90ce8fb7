"""The parallel degrees of a job, derived from its parallel and cluster sections: the object a
torchtitan reader expects (its ParallelDims), for code that wants every degree as a number
rather than the spec's fields, where dp, the Ulysses degree and the ring degree may be left
out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctxlaunch.contract.spec.cluster_section import ClusterSpec
    from ctxlaunch.contract.spec.parallel_section import ParallelSpec


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel degree of a job as a number.

    The degrees are derived, not checked: when tp x pp x cp x ep does not divide the GPU count,
    dp is the rounded-down quotient and `fills_world` is false (the spec's validation reports
    it)."""

    dp: int
    """Data parallel degree: parallel.dp, or the GPU count over tp x pp x cp x ep."""
    tp: int
    """Tensor parallel degree."""
    pp: int
    """Pipeline parallel degree (PP ranks, not stages: see virtual_stages)."""
    cp: int
    """Context parallel degree: ulysses x ring."""
    ep: int
    """Expert parallel degree."""
    ulysses: int
    """The Ulysses (inner, all-to-all) degree of the CP group: cp under cp_algorithm ulysses,
    parallel.ulysses_degree under hybrid, 1 under ring."""
    ring: int
    """The ring (outer) degree of the CP group: cp // ulysses."""
    virtual_stages: int
    """Pipeline stages per PP rank (interleaved 1F1B above 1)."""
    world_size: int
    """Ranks of the job: nodes x gpus_per_node."""

    @classmethod
    def from_sections(cls, parallel: ParallelSpec, cluster: ClusterSpec) -> ParallelDims:
        """The degrees the `parallel` section sets on the GPUs of the `cluster` section."""
        p = parallel
        world_size = cluster.world_size
        if p.cp_algorithm == "ulysses":
            ulysses = p.cp
        elif p.cp_algorithm == "hybrid":
            ulysses = p.ulysses_degree or 1
        else:
            ulysses = 1
        ranks_per_replica = p.tp * p.pp * p.cp * p.ep
        return cls(
            dp=p.dp if p.dp is not None else world_size // ranks_per_replica,
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            ulysses=ulysses,
            ring=p.cp // ulysses,
            virtual_stages=p.virtual_stages,
            world_size=world_size,
        )

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one data-parallel replica: tp x pp x cp x ep."""
        return self.tp * self.pp * self.cp * self.ep

    @property
    def fills_world(self) -> bool:
        """Whether tp x pp x cp x ep x dp is exactly the job's rank count."""
        return self.ranks_per_replica * self.dp == self.world_size

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp x virtual_stages."""
        return self.pp * self.virtual_stages
