# Shapes: SDPA order everywhere: (B, H, S_local, D) shards in, (B, H, S_local, D) shards out.
"""Context-parallel attention (ring, Ulysses, hybrid) on torch alone.

Every function takes this rank's shards, as :func:`shard_sequence` cuts them over the CP group,
and returns this rank's output shard; all are differentiable and support GQA.
"""

from .balance import balanced_spans
from .comm import simulated_link_delay
from .documents import AttentionArea, attention_area, ring_rank_areas
from .hybrid import hybrid_attention, new_hybrid_groups
from .reference import full_attention
from .ring import ring_attention
from .sharding import (
    SHARDINGS,
    check_seq_len,
    shard_for_rank,
    shard_indices,
    shard_positions,
    shard_sequence,
    unshard_from_shards,
    unshard_indices,
    unshard_sequence,
)
from .ulysses import ulysses_attention

__all__ = [
    "SHARDINGS",
    "AttentionArea",
    "attention_area",
    "balanced_spans",
    "check_seq_len",
    "full_attention",
    "hybrid_attention",
    "new_hybrid_groups",
    "ring_attention",
    "ring_rank_areas",
    "shard_for_rank",
    "shard_indices",
    "shard_positions",
    "shard_sequence",
    "simulated_link_delay",
    "ulysses_attention",
    "unshard_from_shards",
    "unshard_indices",
    "unshard_sequence",
]
