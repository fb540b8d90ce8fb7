"""A checkpoint that cannot be read as this model's: another model's (a shape that differs), given
to `ctxlaunch eval` or found on resume, and a data file cut short or missing, given to `export`
or `eval`. Each is exit 2 and one sentence naming the checkpoint's file (and, for another model,
the tensor and both shapes) before any weight is copied, never torch's traceback. The
checkpoints are the real trainer's, of a tiny Llama; the other model is the same spec with a
wider FFN."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
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
    result = run_ctxlaunch("eval", str(spec), "--checkpoint", str(step), env=rank_env())
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


def rank_env() -> dict[str, str]:
    """The environment of a command that starts ranks: no launcher variables, a free port."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["MASTER_PORT"] = str(free_port())
    return env


@pytest.mark.timeout(240)
@pytest.mark.parametrize("damage", ["cut short", "missing"])
def test_a_damaged_data_file_is_named_by_export_and_eval(
    damage: str, trained: Path, tmp_path: Path
) -> None:
    step = tmp_path / "step-00000001"
    shutil.copytree(trained / "checkpoints" / "step-00000001", step)
    data_file = next(step.glob("*.distcp"))
    if damage == "cut short":
        data_file.write_bytes(data_file.read_bytes()[:100])
        words = f"{data_file} is cut short: 100 bytes, but the checkpoint's metadata places data"
    else:
        data_file.unlink()
        words = f"{data_file} is missing (the checkpoint's metadata places data in it)"
    exported = run_ctxlaunch("export", str(step), "--hf", str(tmp_path / "new" / "hf"))
    assert exported.returncode == 2, exported.stderr
    assert "Traceback" not in exported.stderr and words in " ".join(exported.stderr.split())
    assert not (tmp_path / "new").exists()
    if damage == "cut short":  # eval reads it as export does: once is enough to run ranks for
        evaluated = run_ctxlaunch(
            "eval", str(trained / "job.yaml"), "--checkpoint", str(step), env=rank_env()
        )
        assert evaluated.returncode == 2, evaluated.stderr
        text = " ".join(evaluated.stderr.split())
        assert "Traceback" not in evaluated.stderr and f"evaluation refused: {words}" in text


@pytest.mark.timeout(240)
def test_resume_from_another_models_deepspeed_checkpoint_exits_2(tmp_path: Path) -> None:
    """DeepSpeed (ZeRO-1) reads its own checkpoint: its size-mismatch error becomes the same
    one sentence naming the checkpoint and the tensor, exit 2."""
    first = train(tiny_job(tmp_path, steps=1, zero_stage=1), tmp_path / "run")
    assert first.returncode == 0, first.stderr
    spec = other_model_spec(tmp_path, "resume-other.yaml")
    result = train(spec, tmp_path / "run-other", "training.steps=2")
    assert result.returncode == 2, result.stderr
    text = " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    step = tmp_path / "checkpoints" / "step-00000001"
    assert f"error: {step} does not hold this model's weights" in text, text
    assert "blocks.1.ffn.w_down.weight" in text and "it was saved by a different model" in text


@pytest.mark.timeout(240)
@pytest.mark.parametrize("claim", ["negative", "2^60 elements"])
def test_export_checks_declared_shapes_before_allocating_them(
    claim: str, trained: Path, tmp_path: Path
) -> None:
    """A checkpoint whose metadata declares a tensor of a negative size or of 2^60 elements:
    `export` compares the declared shapes with the model before it allocates anything (it
    allocated what was declared, and exited 1 with torch's error), exit 2 naming the tensor."""
    import pickle

    step = tmp_path / "step-00000001"
    shutil.copytree(trained / "checkpoints" / "step-00000001", step)
    metadata = pickle.loads((step / ".metadata").read_bytes())  # the trainer's own file
    key = "model/blocks.0.ffn.w_down.weight#0"
    meta = metadata.state_dict_metadata[key]
    size = [-1, HIDDEN] if claim == "negative" else [2**30, 2**30]
    meta.size = torch.Size(size)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    exported = run_ctxlaunch("export", str(step), "--hf", str(tmp_path / "hf"))
    assert exported.returncode == 2, exported.stderr
    said = " ".join(exported.stderr.split())
    words = "a size is negative" if claim == "negative" else "more than this model's"
    assert f"declares {key} of shape {size}" in said and words in said, said
    assert "Traceback" not in exported.stderr and not (tmp_path / "hf").exists()
