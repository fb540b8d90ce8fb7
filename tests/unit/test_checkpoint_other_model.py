"""A checkpoint of another model (a shape that differs) given to `ctxlaunch eval` or found on
resume: exit 2 and one sentence naming the checkpoint, the tensor and both shapes, before any
weight is copied, never torch's traceback. The checkpoint is the real trainer's, of a tiny
Llama; the other model is the same spec with a wider FFN."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.helpers.checkpoints import LAUNCHER_VARIABLES, run_ctxlaunch, tiny_job, train
from tests.helpers.paths import free_port
from tests.helpers.tiny_hf import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama trained one step, its checkpoint committed."""
    root = tmp_path_factory.mktemp("trained")
    result = train(tiny_job(root, steps=1), root / "run")
    assert result.returncode == 0, result.stderr
    return root


def other_model_spec(root: Path, name: str) -> Path:
    """The trained job's spec with the model given in full, its FFN wider than the checkpoint's."""
    data = yaml.safe_load((root / "job.yaml").read_text())
    data["model"] = {
        "dtype": "fp32",
        "layers": LAYERS,
        "hidden": HIDDEN,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "ffn_hidden": FFN + 32,
        "vocab": VOCAB,
    }
    path = root / name
    path.write_text(yaml.safe_dump(data))
    return path


WORDS = (
    "holds model/blocks.0.ffn.w_down.weight#0 of shape [32, 64], but this model's "
    "blocks.0.ffn.w_down.weight needs [32, 96]: it was saved by a different model"
)


@pytest.mark.timeout(240)
def test_eval_of_another_models_checkpoint_exits_2_naming_tensor_and_shapes(
    trained: Path,
) -> None:
    step = trained / "checkpoints" / "step-00000001"
    spec = other_model_spec(trained, "eval-other.yaml")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["MASTER_PORT"] = str(free_port())
    result = run_ctxlaunch("eval", str(spec), "--checkpoint", str(step), env=env)
    assert result.returncode == 2, result.stderr
    text = " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert f"evaluation refused: checkpoint {step} {WORDS}" in text, text


@pytest.mark.timeout(240)
def test_resume_from_another_models_checkpoint_exits_2_and_keeps_it(trained: Path) -> None:
    spec = other_model_spec(trained, "resume-other.yaml")
    step = trained / "checkpoints" / "step-00000001"
    before = sorted(p.name for p in step.iterdir())
    result = train(spec, trained / "run-other", "training.steps=2")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"error: checkpoint {step} {WORDS}" in " ".join(result.stderr.split())
    assert sorted(p.name for p in step.iterdir()) == before  # nothing removed or skipped
