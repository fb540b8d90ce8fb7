"""Expert parallelism folded over DP x CP, exact: the language-model and load-balancing losses,
the logits and every gradient of a mixture-of-experts model imported from a random
transformers checkpoint equal one process's over the same micro-batches (the cross-layout
tolerance), at EP 2 x DP 2, CP 2 ring (zigzag) x EP 2, CP 2 Ulysses x EP 2, CP 4 hybrid x
EP 4, TP 2 x CP 2 x EP 2, PP 2 x EP 2, FSDP2 with EP 2, DeepSpeed ZeRO-1 and ZeRO-2 with EP 2
(the experts DeepSpeed's MoE parameters; at DP 4 x EP 2 too, where two ranks share them) and
with EP 1, full activation checkpointing, a
document-masked balanced batch at CP 2 x EP 2; a checkpoint saved at EP 2 resumes at EP 1 and
at EP 4, and one DeepSpeed saved at EP 2 at EP 2 (DeepSpeed's own format resumes only at its
layout) (multi-process, gloo on CPU, fp32).

One process is checked against transformers itself in test_moe.py. The load-balancing loss's
statistics cover a micro-batch on every rank, so the one process a layout is compared with
runs its DP ranks' micro-batches as one (micro_batch x dp). Several layouts share one spawned
job of each world size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
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
            "training.checkpoint.dir=null",
            f"training.micro_batch={micro}",
            "training.grad_accum=null",
        ],
    )
    return validate_spec(data).model_dump(mode="json")


def corpus(directory: Path, vocab: int = 64, documents: int = 80) -> str:
    """Documents of 1..40 ids below `vocab` (the tiny model's), each ending in 0."""
    from ctxlaunch.runtime.data.indexed import IndexedWriter, token_dtype

    rng = np.random.default_rng(0)
    prefix = directory / "docs"
    with IndexedWriter(prefix, token_dtype(vocab)) as writer:
        for _ in range(documents):
            writer.add_document(np.append(rng.integers(1, vocab, rng.integers(1, 40)), 0))
    return str(prefix)


def _save_then_resume(rank: int, world: int, saving: dict, resuming: list[dict]) -> dict:
    """Two steps at one layout and a checkpoint; then, in the same job, that checkpoint
    resumed at each other layout for the last two steps: (loss, aux loss) of each step."""
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    def trainer_for(data: dict) -> Trainer:
        spec = validate_spec(data)
        context = build_context(spec.parallel_dims, rank=rank)
        return Trainer(spec, context, torch.device("cpu"), log=lambda _: None)

    first = trainer_for(saving)
    before = [first.train_step() for _ in range(2)]
    first.save_checkpoint()
    after = []
    for data in resuming:
        trainer = trainer_for(data)
        assert trainer.resume() == 2
        after.append([(m.loss, m.aux_loss) for m in (trainer.train_step() for _ in range(2))])
    return {"before": [(m.loss, m.aux_loss) for m in before], "after": after}


def _run_cases(rank: int, world: int, cases: list[tuple[str, Any]]) -> list[Any]:
    """Each case in turn, in one job: ("steps", spec): two steps; ("eval", spec): two steps
    and the evaluation of the weights the spec starts from; ("resume", (saving, resuming))."""
    from tests.helpers.trainer_steps import evaluate_rank

    out: list[Any] = []
    for kind, case in cases:
        if kind == "resume":
            out.append(_save_then_resume(rank, world, *case))
        elif kind == "eval":
            steps = train_steps(rank, world, case, STEPS)
            out.append({**steps, "eval": evaluate_rank(rank, world, case)})
        else:
            out.append(train_steps(rank, world, case, STEPS))
    return out


def _check(names: list[str], cases: list[tuple[str, Any]], results: list[Any]) -> None:
    """Every "steps" and "eval" case against one process (each distinct one run once)."""
    references: dict[str, dict] = {}
    for name, (kind, spec), got in zip(names, cases, results, strict=True):
        if kind == "resume":
            continue
        single = one_process(spec)
        key = json.dumps(single, sort_keys=True)
        if key not in references:
            references[key] = _run_cases(0, 1, [(kind, single)])[0]
        want = references[key]
        torch.testing.assert_close(
            torch.tensor(got["aux_losses"]),
            torch.tensor(want["aux_losses"]),
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m, n=name: f"{n} load-balancing losses: {m}",
        )
        assert min(want["aux_losses"]) > 0
        worst = assert_matches_one_process(got, want, name)
        if kind == "eval":
            assert got["eval"]["tokens"] == want["eval"]["tokens"] > 0
            assert got["eval"]["loss"] == pytest.approx(want["eval"]["loss"], rel=1e-5), name
        loss = max(abs(g - w) for g, w in zip(got["losses"], want["losses"], strict=True))
        aux = max(abs(g - w) for g, w in zip(got["aux_losses"], want["aux_losses"], strict=True))
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
    "DeepSpeed ZeRO-2 x EP 2": {
        "parallel.ep": 2,
        "training.zero_stage": 2,
        "training.engine": "deepspeed",
    },
    "DeepSpeed ZeRO-1 x EP 2": {
        "parallel.ep": 2,
        "training.zero_stage": 1,
        "training.engine": "deepspeed",
    },
    "CP 2 x EP 2, full checkpointing": {
        "parallel.cp": 2,
        "parallel.ep": 2,
        "training.activation_checkpointing": "full",
    },
}


@pytest.mark.timeout(900)
def test_world_2_layouts_match_one_process(tmp_path: Path) -> None:
    """The world-2 layouts above (Qwen3-MoE); Mixtral's always renormalised router and
    Qwen2-MoE's shared expert with its gate and a dense layer among the sparse ones at EP 2 x
    DP 2; and a document-masked batch under the balanced sharding at CP 2 x EP 2, with the
    held-out evaluation at that layout scoring what one process scores; and a checkpoint
    DeepSpeed ZeRO-2 saved at EP 2 (each rank's experts and their Adam moments in its own
    partition files) resumed at EP 2: both losses of every step those of the uninterrupted
    run in one process; reading its weights for an export, and resuming it at EP 1, are
    refused in one sentence each."""
    names, cases = [], []
    for family in ("qwen3_moe", "mixtral", "qwen2_moe"):
        source = tmp_path / family
        save_hf(source, hf_config("default", family=family))
        layouts = WORLD2 if family == "qwen3_moe" else {"EP 2 x DP 2": WORLD2["EP 2 x DP 2"]}
        names += [f"{family} {name}" for name in layouts]
        cases += [("steps", spec) for spec in _specs(source, 2, list(layouts.values()))]
    documents = {
        "training.data.source": "tokens",
        "training.data.path": corpus(tmp_path),
        "training.data.document_mask": True,
        "training.data.eval_fraction": 0.3,
        "training.eval.sequences": 2,
        "training.eval.passkey.enabled": False,
        "parallel.cp_sharding": "balanced",
        "parallel.cp": 2,
        "parallel.ep": 2,
    }
    names.append("qwen3_moe document mask, balanced, CP 2 x EP 2, evaluation")
    cases += [("eval", spec) for spec in _specs(tmp_path / "qwen3_moe", 2, [documents])]
    deepspeed = {
        **WORLD2["DeepSpeed ZeRO-2 x EP 2"],
        "training.steps": 4,
        "training.checkpoint.dir": str(tmp_path / "ckpt"),
    }
    (saving,) = _specs(tmp_path / "qwen3_moe", 2, [deepspeed])
    names.append("DeepSpeed ZeRO-2 x EP 2 resumed at EP 2")
    cases.append(("resume", (saving, [saving])))
    results = run_distributed(_run_cases, 2, cases, timeout_s=840)[0]
    _check(names, cases, results)
    _check_resumed(saving, results[-1])
    # zero_to_fp32 cannot merge experts kept in each rank's partition files: export says so;
    # and DeepSpeed's format resumes at its own EP degree only: another is refused.
    from ctxlaunch.runtime.checkpointing.hf import HFCheckpointError, read_training_weights
    from ctxlaunch.runtime.checkpointing.safe_unpickle import CheckpointOfAnotherModel
    from ctxlaunch.runtime.trainer.engines import check_deepspeed_ep

    step = next((tmp_path / "ckpt").glob("step-*"))
    with pytest.raises(HFCheckpointError, match="saved by DeepSpeed with expert parallelism"):
        read_training_weights(step)
    check_deepspeed_ep(step, 2)
    with pytest.raises(CheckpointOfAnotherModel, match="saved by DeepSpeed at ep = 2"):
        check_deepspeed_ep(step, 1)


def _check_resumed(saving: dict, got: dict) -> None:
    """A `_save_then_resume` result against the uninterrupted run in one process."""
    straight = train_steps(0, 1, one_process(saving), 4)
    want = list(zip(straight["losses"], straight["aux_losses"], strict=True))
    torch.testing.assert_close(got["before"], want[:2], rtol=1e-5, atol=1e-6)
    for losses in got["after"]:
        torch.testing.assert_close(losses, want[2:], rtol=1e-5, atol=1e-6)


WORLD4 = {
    "CP 4 hybrid (Ulysses 2 x ring 2) x EP 4": {
        "parallel.cp": 4,
        "parallel.cp_algorithm": "hybrid",
        "parallel.ulysses_degree": 2,
        "parallel.ep": 4,
    },
    "TP 2 x CP 2 x EP 2": {"parallel.tp": 2, "parallel.cp": 2, "parallel.ep": 2},
    "PP 2 x DP 2 x EP 2": {"parallel.pp": 2, "parallel.ep": 2},
    # The world-2 DeepSpeed cases hold each rank's experts alone; here two ranks share them.
    "DeepSpeed ZeRO-2 x DP 4 x EP 2 (experts sharded over 2 ranks)": {
        "parallel.ep": 2,
        "training.zero_stage": 2,
        "training.engine": "deepspeed",
    },
    "PP 2 x CP 2 x EP 2, FSDP2 ZeRO-1": {
        "parallel.pp": 2,
        "parallel.cp": 2,
        "parallel.ep": 2,
        "training.zero_stage": 1,
        "training.engine": "fsdp2",
    },
}


@pytest.mark.timeout(900)
def test_world_4_layouts_and_resume_at_other_ep_degrees(tmp_path: Path) -> None:
    """The world-4 layouts above (a 4-layer Qwen3-MoE, so each pipeline stage holds two
    sparse layers), and a checkpoint saved at CP 2 x DP 2 x EP 2 (experts and their Adam
    moments under whole-model names) resumed at EP 1 and at EP 4: both losses of every step
    those of the uninterrupted run in one process."""
    source = tmp_path / "source"
    save_hf(source, hf_config("default", family="qwen3_moe", layers=4))
    names = list(WORLD4)
    cases: list[tuple[str, Any]] = [
        ("steps", spec) for spec in _specs(source, 4, list(WORLD4.values()))
    ]
    common = {
        "training.steps": 4,
        "training.checkpoint.dir": str(tmp_path / "ckpt"),
        "parallel.cp": 2,
    }
    saving, *resuming = _specs(source, 4, [{**common, "parallel.ep": ep} for ep in (2, 1, 4)])
    names.append("resume at EP 1 and EP 4")
    cases.append(("resume", (saving, resuming)))
    results = run_distributed(_run_cases, 4, cases, timeout_s=840)[0]
    _check(names, cases, results)
    _check_resumed(saving, results[-1])
