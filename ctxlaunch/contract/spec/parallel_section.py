"""The parallel section of the job spec: the degrees, the CP algorithm and how the sequence is
sharded, with the fields still read under their old names."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import PrivateAttr, model_validator

from ctxlaunch.contract.spec.fields import PositiveInt, _Strict


class ParallelSpec(_Strict):
    """The parallel layout. TP x PP x CP x DP = nodes x gpus_per_node. Rank order (innermost
    first): TP, CP, DP, PP, so a CP group is consecutive ranks, inside a node where it fits.
    Expert parallelism (ep) is folded over DP x CP and takes no ranks of its own."""

    tp: PositiveInt = 1
    """Tensor parallel degree."""
    pp: PositiveInt = 1
    """Pipeline parallel degree."""
    virtual_stages: PositiveInt = 1
    """Pipeline stages per PP rank: above 1 the trainer runs interleaved 1F1B over pp x
    virtual_stages stages (rank r holds stages r, r + pp, ...), shrinking the bubble."""
    stage_layers: list[PositiveInt] | None = None
    """Optional: blocks per pipeline stage, first to last (pp x virtual_stages entries summing
    to model.layers). Default: balanced, counting the embedding and the loss head as one layer
    each on the end stages (see ctxlaunch.contract.stages)."""
    cp: PositiveInt = 1
    """Context parallel degree: the sequence is split across this many ranks."""
    ep: PositiveInt = 1
    """Expert parallel degree, for a mixture-of-experts model (model.moe): each layer's experts
    are split over ep consecutive ranks of the DP x CP ranks holding the same dense weights,
    which exchange tokens by all-to-all. Folded over DP x CP (torchtitan's and Megatron's MoE
    parallel folding), it takes no ranks of its own: it must divide dp x cp and
    model.moe.experts."""
    dp: PositiveInt | None = None
    """Data parallel degree; derived from the GPU count when not given."""
    cp_algorithm: Literal["ring", "ulysses", "hybrid"] = "ring"
    """ring: K/V blocks travel around the CP ranks; ulysses: all-to-all to head-sharded
    attention (degree <= kv_heads); hybrid: Ulysses inside each group of ulysses_degree ranks x
    ring across the groups."""
    ulysses_degree: PositiveInt | None = None
    """Hybrid only: the Ulysses (inner) degree; ring degree = cp / ulysses_degree."""
    ring_degree: PositiveInt | None = None
    """Hybrid only, optional: the ring (outer) degree; must equal cp / ulysses_degree."""
    cp_sharding: Literal["zigzag", "contiguous", "balanced"] = "zigzag"
    """How the sequence is split across CP ranks (what torch's context parallel calls the load
    balancer): zigzag (rank i holds chunks i and 2N-1-i of 2N, balancing causal work; needs
    seq_len % 2N == 0), contiguous (seq_len % N == 0), or balanced (under a document mask,
    placed per sequence by its documents so that every rank computes the same attention area:
    long documents cut head-tail over all ranks, the others whole; needs seq_len % 2N == 0, and
    without a document mask it is zigzag). Default: balanced under training.data.document_mask
    with a ring or hybrid CP, zigzag otherwise. Formerly `layout`, still accepted with a
    deprecation warning."""

    _renamed: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _accept_renamed_fields(cls, data: Any, handler: Any) -> ParallelSpec:
        """Take a field under its old name (RENAMED_PARALLEL_FIELDS), warning once."""
        renamed: list[str] = []
        if isinstance(data, dict):
            data = dict(data)
            for old, new in RENAMED_PARALLEL_FIELDS.items():
                if old not in data:
                    continue
                value = data.pop(old)
                if new in data and data[new] != value:
                    raise ValueError(
                        f"parallel.{old} (the old name of parallel.{new}) is "
                        f"{value!r} but parallel.{new} is {data[new]!r}; fix: "
                        f"give only parallel.{new}"
                    )
                data[new] = value
                renamed.append(
                    f"parallel.{old} is deprecated: write parallel.{new} (the same values)"
                )
                warnings.warn(renamed[-1], DeprecationWarning, stacklevel=2)
        spec = handler(data)
        spec._renamed = renamed
        return spec

    @property
    def deprecations(self) -> list[str]:
        """One sentence per field given under its old name."""
        return list(self._renamed)


RENAMED_PARALLEL_FIELDS = {"layout": "cp_sharding"}
"""Old name -> new name of `parallel` fields that are still read under the old one."""
