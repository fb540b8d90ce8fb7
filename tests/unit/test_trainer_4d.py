"""End-to-end exactness of the trainer with tensor and pipeline parallelism composed with CP
and DP: every layout trains to the same losses and (gathered) gradients as one process over
the whole sequence (multi-process, gloo on CPU).

Several layouts share one spawned job of the same world size (spawning is the expensive part
on a small machine); each builds its own process groups inside it."""

from __future__ import annotations

import pytest
import torch

from ctxlaunch.contract.loader import validate_spec
from tests.helpers.dist import run_distributed
from tests.helpers.trainer_steps import assert_matches_one_process, spec_for
from tests.helpers.trainer_steps import train_steps as run_layout

pytestmark = pytest.mark.distributed

STEPS = 2
COMMON = {"training.global_batch": 4, "training.steps": STEPS}

# world -> [(model changes, layout changes)]
LAYOUTS: dict[int, list[tuple[dict, dict]]] = {
    2: [({}, {"parallel.tp": 2}), ({}, {"parallel.pp": 2})],
    4: [
        ({}, {"parallel.tp": 2, "parallel.cp": 2, "parallel.cp_algorithm": "ring"}),
        (
            {"model.preset": "tiny-mha"},
            {"parallel.tp": 2, "parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
        ),
        # ZeRO-3 through FSDP2 over DP x CP.
        ({}, {"parallel.pp": 2, "parallel.cp": 2, "training.zero_stage": 3}),
        # Full activation checkpointing: the TP collectives run again in the recomputation.
        ({}, {"parallel.tp": 2, "parallel.pp": 2, "training.activation_checkpointing": "full"}),
        # DP 2 x PP 2, interleaved (two virtual stages per rank), one block per stage.
        ({"model.layers": 4}, {"parallel.pp": 2, "parallel.virtual_stages": 2}),
    ],
    8: [
        ({}, {"parallel.tp": 2, "parallel.pp": 2, "parallel.cp": 2}),
        ({}, {"parallel.tp": 2, "parallel.pp": 2, "parallel.cp": 2, "training.zero_stage": 1}),
        (
            {"model.preset": "tiny-mha"},
            {
                "parallel.tp": 2,
                "parallel.cp": 4,
                "parallel.cp_algorithm": "hybrid",
                "parallel.ulysses_degree": 2,
            },
        ),
        # Uneven stages (3 + 1 blocks) with DP 2 x TP 2, ZeRO-2 through FSDP2 over DP.
        (
            {"model.layers": 4},
            {
                "parallel.tp": 2,
                "parallel.pp": 2,
                "parallel.stage_layers": "[3, 1]",
                "training.zero_stage": 2,
            },
        ),
    ],
}


def _run_all(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [run_layout(rank, world, spec, STEPS) for spec in specs]


def single_process(model_changes: dict) -> dict:
    """The oracle: one process, the whole sequence, ZeRO-0 (in this process: no spawn)."""
    spec = spec_for(1, **model_changes, **COMMON)
    return run_layout(0, 1, spec, STEPS)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_tp_pp_layouts_match_single_process(world: int) -> None:
    cases = LAYOUTS[world]
    specs = [spec_for(world, **model, **layout, **COMMON) for model, layout in cases]
    results = run_distributed(_run_all, world, specs, timeout_s=360)[0]
    for (model, layout), got in zip(cases, results, strict=True):
        want = single_process(model)
        worst = assert_matches_one_process(got, want)
        loss_diff = max(abs(g - w) for g, w in zip(got["losses"], want["losses"]))
        print(
            f"world {world} {model} {layout}: max loss diff {loss_diff:.2e}, max grad diff "
            f"abs {worst[0]:.2e} rel {worst[1]:.2e}"
        )


def _save_then_resume(
    rank: int, world: int, saving: dict, resuming: list[dict], checkpoint_dir: str
) -> dict:
    """Train two steps at one layout and checkpoint; then, in the same job, resume that
    checkpoint at each other layout and train the last two steps."""
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    def trainer_for(spec_data: dict) -> Trainer:
        spec = validate_spec(spec_data)
        ctx = build_context(spec.parallel_dims, rank=rank)
        return Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)

    first = trainer_for(saving)
    before = [first.train_step().loss for _ in range(2)]
    first.save_checkpoint()
    after = []
    for spec_data in resuming:
        trainer = trainer_for(spec_data)
        assert trainer.resume() == 2
        after.append([trainer.train_step().loss for _ in range(2)])
    return {"before": before, "after": after}


@pytest.mark.timeout(420)
def test_checkpoint_resumes_at_other_layouts(tmp_path) -> None:
    """Saved at TP 2 x PP 2, resumed at TP 1 x PP 4, at CP 4 (no TP/PP) and at TP 2 x DP 2
    with ZeRO-2 (FSDP2): the losses of the uninterrupted single-process run."""
    model = {"model.layers": 4}
    common = {
        **model,
        **COMMON,
        "training.steps": 4,
        "training.checkpoint.dir": str(tmp_path / "ckpt"),
    }
    saving = spec_for(4, **common, **{"parallel.tp": 2, "parallel.pp": 2})
    resuming = [
        spec_for(4, **common, **{"parallel.pp": 4}),
        spec_for(4, **common, **{"parallel.cp": 4}),
        spec_for(4, **common, **{"parallel.tp": 2, "training.zero_stage": 2}),
    ]
    got = run_distributed(
        _save_then_resume, 4, saving, resuming, str(tmp_path / "ckpt"), timeout_s=360
    )[0]
    from ctxlaunch.contract.parallel_dims import ParallelDims
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(spec_for(1, **{**model, **COMMON, "training.steps": 4}))
    ctx = build_context(ParallelDims(), rank=0)
    straight = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    want = [straight.train_step().loss for _ in range(4)]
    torch.testing.assert_close(got["before"], want[:2], rtol=1e-5, atol=1e-6)
    for losses in got["after"]:
        torch.testing.assert_close(losses, want[2:], rtol=1e-5, atol=1e-6)
    print("resume: uninterrupted", want, "resumed", got["after"])
