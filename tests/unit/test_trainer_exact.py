"""End-to-end exactness of the trainer: every CP layout (ring, Ulysses, hybrid; ZeRO 0 and 2)
trains to the same losses and gradients as one process over the whole sequence, and a resumed
run reproduces an uninterrupted one exactly (multi-process, gloo on CPU)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from ctxlaunch.contract.loader import validate_spec
from tests.helpers.dist import run_distributed
from tests.helpers.trainer_steps import assert_matches_one_process, spec_for, train_steps

pytestmark = pytest.mark.distributed


def train(world: int, spec_data: dict, steps: int = 3) -> dict:
    return run_distributed(train_steps, world, spec_data, steps, timeout_s=240)[0]


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, the whole sequence, ZeRO-0: the oracle."""
    return {
        model: train(1, spec_for(1, **{"model.preset": model})) for model in ("tiny", "tiny-mha")
    }


LAYOUTS = [
    # (model, world, changes)
    ("tiny", 2, {"parallel.cp": 2, "parallel.cp_algorithm": "ring"}),
    ("tiny", 4, {"parallel.cp": 4, "parallel.cp_algorithm": "ring"}),
    (
        "tiny",
        2,
        {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "contiguous"},
    ),
    ("tiny", 2, {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"}),
    ("tiny-mha", 4, {"parallel.cp": 4, "parallel.cp_algorithm": "ulysses"}),
    (
        "tiny",
        4,
        {"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_degree": 2},
    ),
    ("tiny", 4, {"parallel.cp": 2, "parallel.cp_algorithm": "ring"}),  # DP 2 x CP 2
    ("tiny", 2, {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "training.zero_stage": 2}),
    (
        "tiny-mha",
        2,
        {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses", "training.zero_stage": 2},
    ),
    (
        "tiny",
        4,
        {
            "parallel.cp": 4,
            "parallel.cp_algorithm": "hybrid",
            "parallel.ulysses_degree": 2,
            "training.zero_stage": 2,
        },
    ),
]


def _id(case) -> str:
    model, world, changes = case
    return f"{model}-w{world}-" + "-".join(f"{k.split('.')[-1]}={v}" for k, v in changes.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", LAYOUTS, ids=_id)
def test_layout_matches_single_process(case, reference: dict) -> None:
    model, world, changes = case
    got = train(world, spec_for(world, **{"model.preset": model}, **changes))
    want = reference[model]
    assert_matches_one_process(got, want)


def _run_with_stop(rank: int, world: int, spec_data: dict, stop_after: int | None) -> dict:
    """Trainer.run(), sending this process SIGUSR1 after `stop_after` steps (a preemption)."""
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    losses: list[float] = []

    def observe(metrics) -> None:
        losses.append(metrics.loss)
        if stop_after is not None and metrics.step == stop_after:
            os.kill(os.getpid(), signal.SIGUSR1)

    code = trainer.run(observers=[observe])
    return {"code": code, "losses": losses, "step": trainer.step}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 2])
def test_resume_reproduces_the_uninterrupted_run_exactly(zero: int, tmp_path: Path) -> None:
    common = {
        "parallel.cp": 2,
        "training.steps": 6,
        "training.zero_stage": zero,
        "training.checkpoint.interval": 100,
    }
    straight = run_distributed(
        _run_with_stop,
        2,
        spec_for(2, **common, **{"training.checkpoint.dir": str(tmp_path / "a")}),
        None,
        timeout_s=240,
    )[0]
    assert straight["code"] == 0 and len(straight["losses"]) == 6

    ckpt = str(tmp_path / "b")
    spec_b = spec_for(2, **common, **{"training.checkpoint.dir": ckpt})
    first = run_distributed(_run_with_stop, 2, spec_b, 3, timeout_s=240)[0]
    # The signal lands after step 3's collective; the ranks agree on it in step 4's, finish
    # that step, checkpoint and ask to be requeued.
    assert first["code"] == 75 and first["step"] == 4
    assert (Path(ckpt) / "step-00000004" / "COMMITTED").is_file()
    second = run_distributed(_run_with_stop, 2, spec_b, None, timeout_s=240)[0]
    assert second["code"] == 0 and second["step"] == 6
    assert first["losses"] + second["losses"] == straight["losses"]  # exactly, not approximately
