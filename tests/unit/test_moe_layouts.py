"""Expert parallelism folded over DP x CP, exact: the language-model and load-balancing losses,
the logits and every gradient of a mixture-of-experts model imported from a random
transformers checkpoint equal one process's over the same micro-batches (the cross-layout
tolerance), at EP 2 x DP 2, CP 2 ring (zigzag) x EP 2, CP 2 Ulysses x EP 2, CP 4 hybrid x
EP 4, TP 2 x CP 2 x EP 2, PP 2 x EP 2, FSDP2 with EP 2, DeepSpeed ZeRO-2 (EP 1: DeepSpeed's
ZeRO reduces every gradient over DP x CP), full activation checkpointing, a document-masked
balanced batch at CP 2 x EP 2; and a checkpoint saved at EP 2 resumes at EP 1 and at EP 4
(multi-process, gloo on CPU, fp32).

One process is checked against transformers itself in test_moe.py. The load-balancing loss's
statistics cover a micro-batch on every rank, so the one process a layout is compared with
runs its DP ranks' micro-batches as one (micro_batch x dp). Several layouts share one spawned
job of each world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctxlaunch.contract.loader import apply_overrides, validate_spec
from tests.helpers.dist import run_distributed
from tests.helpers.hf_models import hf_config, save_hf, spec_data
from tests.helpers.trainer_steps import assert_matches_one_process, train_steps

pytestmark = pytest.mark.distributed

STEPS = 2
COMMON = {"training.global_batch": 4, "training.steps": STEPS, "training.optimizer.eps": 1e-6}


def _specs(source: Path, world: int, layouts: list[dict]) -> list[dict]:
    return [
        validate_spec(spec_data(source, world, **{**COMMON, **layout})).model_dump(mode="json")
        for layout in layouts
    ]


def one_process(spec: dict) -> dict:
    """The same micro-batches in one process: each DP step's micro-batches as one."""
    dims = validate_spec(spec).parallel_dims
    micro = spec["training"]["micro_batch"] * dims.dp
    data = apply_overrides(
        spec,
        [
            "cluster.gpus_per_node=1",
            "parallel={}",
            "training.zero_stage=0",
            "training.engine=auto",
            "training.activation_checkpointing=none",
            f"training.micro_batch={micro}",
            "training.grad_accum=null",
        ],
    )
    return validate_spec(data).model_dump(mode="json")


def _run_all(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [train_steps(rank, world, spec, STEPS) for spec in specs]


def _check(world: int, specs: list[dict], names: list[str]) -> None:
    results = run_distributed(_run_all, world, specs, timeout_s=500)[0]
    for name, spec, got in zip(names, specs, results, strict=True):
        want = train_steps(0, 1, one_process(spec), STEPS)
        torch.testing.assert_close(
            torch.tensor(got["aux_losses"]),
            torch.tensor(want["aux_losses"]),
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m, n=name: f"{n} load-balancing losses: {m}",
        )
        assert min(want["aux_losses"]) > 0
        worst = assert_matches_one_process(got, want, name)
        loss = max(abs(g - w) for g, w in zip(got["losses"], want["losses"]))
        aux = max(abs(g - w) for g, w in zip(got["aux_losses"], want["aux_losses"]))
        print(
            f"{name}: max |loss diff| {loss:.1e}, |aux diff| {aux:.1e}, "
            f"max grad diff abs {worst[0]:.1e} rel {worst[1]:.1e}"
        )


WORLD2 = {
    "EP 2 x DP 2": {"parallel.ep": 2},
    "CP 2 ring zigzag x EP 2": {"parallel.cp": 2, "parallel.ep": 2},
    "CP 2 Ulysses x EP 2": {
        "parallel.cp": 2,
        "parallel.cp_algorithm": "ulysses",
        "parallel.ep": 2,
    },
    "FSDP2 ZeRO-2 x EP 2": {
        "parallel.ep": 2,
        "training.zero_stage": 2,
        "training.engine": "fsdp2",
    },
    "FSDP2 ZeRO-3 x EP 1 (experts sharded over DP)": {
        "training.zero_stage": 3,
        "training.engine": "fsdp2",
    },
    "DeepSpeed ZeRO-2 (EP 1)": {"training.zero_stage": 2, "training.engine": "deepspeed"},
    "CP 2 x EP 2, full checkpointing": {
        "parallel.cp": 2,
        "parallel.ep": 2,
        "training.activation_checkpointing": "full",
    },
}


@pytest.mark.timeout(600)
def test_world_2_layouts_match_one_process(tmp_path: Path) -> None:
    source = tmp_path / "source"
    save_hf(source, hf_config("default", family="qwen3_moe"))
    _check(2, _specs(source, 2, list(WORLD2.values())), list(WORLD2))


@pytest.mark.timeout(600)
def test_each_family_at_ep_2_x_dp_2(tmp_path: Path) -> None:
    """Mixtral's always renormalised router and Qwen2-MoE's shared expert with its gate and a
    dense layer among the sparse ones, at EP 2 x DP 2."""
    specs, names = [], []
    for family in ("mixtral", "qwen2_moe"):
        source = tmp_path / family
        save_hf(source, hf_config("default", family=family))
        specs += _specs(source, 2, [{"parallel.ep": 2}])
        names.append(f"{family} EP 2 x DP 2")
    _check(2, specs, names)
