"""How a model's layers split into pipeline stages (pure arithmetic; the validator, the planner
and the trainer all read it, so the plan and the run agree).

The default split is balanced in *effective* layers: the embedding counts as one layer on the
first stage and the output head with its loss as one on the last, so both end stages get one
block fewer when that lowers the busiest stage (Llama 3 405B: 126 layers at PP 16 is 7, 8 x 14,
7). Where the layers divide evenly and the ends would not get lighter (80 layers at PP 8: every
stage holds 10), the split stays even.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4096)  # the planner asks for the same splits many thousand times
def balanced_stage_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage, first to last; every stage gets at least one (needs layers >= stages).

    Start from ceil((layers + 2) / stages) effective layers per stage (ends one block lighter),
    then take the surplus blocks away one at a time from the stage with the heaviest effective
    load, preferring middle stages, so the busiest stage is as light as it can be.
    """
    if stages < 1 or layers < stages:
        raise ValueError(f"cannot split {layers} layers into {stages} stages of >= 1 layer")
    if stages == 1:
        return (layers,)
    per = -(-(layers + 2) // stages)
    split = [per] * stages
    split[0] -= 1
    split[-1] -= 1
    extra = [1] + [0] * (stages - 2) + [1]  # embedding, head and loss
    surplus = sum(split) - layers
    # Ties go to the middle stages (index order among them), then to the ends.
    order = list(range(1, stages - 1)) + [0, stages - 1]
    while surplus > 0:
        candidates = [i for i in order if split[i] > 1]
        heaviest = max(candidates, key=lambda i: split[i] + extra[i])
        split[heaviest] -= 1
        surplus -= 1
    return tuple(split)


def stage_of_layer(stage_layers: tuple[int, ...]) -> list[int]:
    """For each block, the (virtual) stage that holds it."""
    return [stage for stage, count in enumerate(stage_layers) for _ in range(count)]
