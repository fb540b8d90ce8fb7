"""`ctxlaunch eval` of a model.init_from checkpoint as imported, before any training: the
baseline a user compares with after extending the context. The CLI runs real torchrun ranks
(gloo); the reference is transformers' own model of the same saved checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ctxlaunch.contract.loader import apply_overrides, validate_spec
from tests.helpers.hf_models import hf_config, save_hf, spec_data

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")


def _eval_spec(tmp_path: Path, init_from: Path | None, **changes: object) -> Path:
    data = spec_data(init_from or tmp_path, 2)
    if init_from is None:
        data["model"] = {"preset": "tiny", "dtype": "fp32"}
    data = apply_overrides(
        data,
        [
            f"{k}={json.dumps(v)}"
            for k, v in {
                "training.checkpoint.dir": str(tmp_path / "ckpt"),
                "training.eval": {"sequences": 3, "buckets": 2, "passkey": {"enabled": False}},
                "parallel.cp": 2,
                **changes,
            }.items()
        ],
    )
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_eval_scores_the_imported_model_without_a_checkpoint(tmp_path) -> None:
    """A Qwen3 checkpoint (q/k norms, head_dim free of hidden / heads) evaluated at CP 2 with
    no checkpoint committed: the held-out loss is transformers' loss of the same sequences."""
    from ctxlaunch.runtime.evaluation.eval_data import held_out

    reference = save_hf(tmp_path / "qwen3", hf_config(family="qwen3"))
    spec_path = _eval_spec(tmp_path, tmp_path / "qwen3")
    done = subprocess.run(
        [CTXLAUNCH, "eval", str(spec_path), "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["checkpoint"] is None
    assert result["init_from"] == str(tmp_path / "qwen3")

    spec = validate_spec(yaml.safe_load(spec_path.read_text()))
    total, count = 0.0, 0
    with torch.no_grad():
        for sequence in held_out(spec).sequences:
            logits = reference(sequence[None, :-1]).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits, sequence[1:], reduction="sum"))
            count += sequence.numel() - 1
    print(f"base-model held-out loss {result['loss']:.6f} (transformers {total / count:.6f})")
    assert result["loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.timeout(120)
def test_eval_base_without_init_from_is_refused(tmp_path) -> None:
    """--base names what it needs: a model.init_from checkpoint to evaluate as imported."""
    spec_path = _eval_spec(tmp_path, None, **{"cluster.gpus_per_node": 1, "parallel.cp": 1})
    done = subprocess.run(
        [CTXLAUNCH, "eval", str(spec_path), "--base"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--base evaluates model.init_from as imported, and it is not set" in done.stderr
    assert "Traceback" not in done.stderr
