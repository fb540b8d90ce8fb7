"""Offload and tiled compute are exact: each of training.offload's switches,
training.mlp_tile_tokens and training.attention_tile_tokens trains to the plain step's losses
and gradients (one process over the whole sequence, ZeRO-0), at one process, CP 2, FSDP2 and
DeepSpeed (gloo on CPU). The copies to host memory are real copies on the CPU too (the same
code path as on a GPU, without the side stream and the pinning, which need CUDA)."""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.trainer_steps import assert_matches_one_process, spec_for, train_steps

pytestmark = pytest.mark.distributed

FULL = {"training.activation_checkpointing": "full"}
CASES = [
    # (id, world, changes)
    ("tiled", 1, {"training.mlp_tile_tokens": 48}),
    ("tiled-full", 1, {"training.mlp_tile_tokens": 64, **FULL}),
    ("activations", 1, {"training.offload.activations": "true", **FULL}),
    (
        "deepspeed-z2-optimizer",
        1,
        {
            "training.engine": "deepspeed",
            "training.zero_stage": 2,
            "training.offload.optimizer": "true",
        },
    ),
    (
        "cp2-tiled-activations",
        2,
        {
            "parallel.cp": 2,
            "training.mlp_tile_tokens": 48,
            "training.attention_tile_tokens": 48,
            "training.offload.activations": "true",
            **FULL,
        },
    ),
    (
        "cp2-fsdp2-z3-optimizer",
        2,
        {
            "parallel.cp": 2,
            "training.engine": "fsdp2",
            "training.zero_stage": 3,
            "training.offload.optimizer": "true",
        },
    ),
    (
        "cp2-deepspeed-z3-parameters",
        2,
        {
            "parallel.cp": 2,
            "training.engine": "deepspeed",
            "training.zero_stage": 3,
            "training.offload.optimizer": "true",
            "training.offload.parameters": "true",
            "training.mlp_tile_tokens": 48,
            "training.attention_tile_tokens": 48,
        },
    ),
    (
        # The offload recipe on a hybrid layout (what `plan` reaches furthest with on 8 GPUs).
        "cp4-hybrid-recipe",
        4,
        {
            "parallel.cp": 4,
            "parallel.cp_algorithm": "hybrid",
            "parallel.ulysses_degree": 2,
            "training.engine": "deepspeed",
            "training.zero_stage": 3,
            "training.offload.optimizer": "true",
            "training.offload.parameters": "true",
            "training.offload.activations": "true",
            "training.mlp_tile_tokens": 48,
            "training.attention_tile_tokens": 48,
            **FULL,
        },
    ),
]


def train(world: int, spec_data: dict) -> dict:
    return run_distributed(train_steps, world, spec_data, 3, timeout_s=240)[0]


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, the whole sequence, ZeRO-0, nothing offloaded or tiled: the oracle."""
    return train(1, spec_for(1))


# DeepSpeed compiles its CPU Adam op on first use (minutes on two cores), then reuses it.
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_offload_and_tiling_match_the_plain_step(case, reference: dict) -> None:
    _, world, changes = case
    got = train(world, spec_for(world, **changes))
    assert_matches_one_process(got, reference)
