"""Continued pre-training of a Qwen-family model on this machine, from text to export, through
the CLI a user runs: `data prepare` with the checkpoint's own tokenizer, `eval --base` of the
imported model, `train` from `model.init_from` with a raised RoPE base and document masks,
`eval` of the checkpoint, `export`; transformers' `from_pretrained` of the export is a
Qwen3ForCausalLM with the raised base whose logits are the trained weights' (the trainer's
model loaded from the checkpoint). A tiny random Qwen3 checkpoint (q/k norms, head_dim free of
hidden / heads) and a tokenizer trained here stand in for the released ones."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.chat_data import VOCAB_SIZE, WORDS, write_chat_tokenizer
from tests.helpers.checkpoints import lone_rank_env
from tests.helpers.hf_models import hf_config, save_hf

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")


def cli(*args: str, timeout: int = 200) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [CTXLAUNCH, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=lone_rank_env(),
    )
    assert done.returncode == 0, f"ctxlaunch {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_qwen3_from_text_to_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.runtime.checkpointing.reshard import CheckpointState
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.modeling.weight_sharding import shardings

    base = tmp_path / "qwen3-base"
    save_hf(base, hf_config("default", family="qwen3", vocab=VOCAB_SIZE, theta=10000.0))
    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, base / name)
    texts = []
    for number in range(40):
        path = tmp_path / "text" / f"doc{number:02d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(" ".join(WORDS[(number + i) % len(WORDS)] for i in range(20 + number)))
        texts.append(str(path))

    cli("data", "prepare", *texts, "-t", str(base), "-o", str(tmp_path / "data" / "text"))
    spec = {
        "name": "qwen3-extend",
        "model": {"init_from": str(base), "rope_theta": 1000000.0, "dtype": "fp32"},
        "training": {
            "seq_len": 256,
            "micro_batch": 1,
            "global_batch": 2,
            "steps": 2,
            "seed": 3,
            "optimizer": {"lr": 1e-3, "warmup_steps": 1},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 2},
            "data": {
                "source": "tokens",
                "path": str(tmp_path / "data" / "text"),
                "eval_fraction": 0.2,
                "document_mask": True,
            },
            "eval": {"sequences": 2, "buckets": 2, "passkey": {"enabled": False}},
        },
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    before = json.loads(cli("eval", str(spec_path), "--base", "--json").stdout)
    assert before["checkpoint"] is None and before["init_from"] == str(base)
    cli("train", str(spec_path), "--run-dir", str(tmp_path / "run"))
    after = json.loads(cli("eval", str(spec_path), "--json").stdout)
    assert after["checkpoint"] == str(tmp_path / "ckpt" / "step-00000002")
    print(f"held-out loss before {before['loss']:.4f}, after two steps {after['loss']:.4f}")
    cli("export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf"))

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    assert type(exported).__name__ == "Qwen3ForCausalLM"
    assert exported.config.rope_parameters["rope_theta"] == 1000000.0
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    tokens = torch.tensor([tokenizer.encode(" ".join(WORDS * 3))[:200]])
    job = validate_spec(spec)
    model = Transformer.from_spec(job.model)
    CheckpointState(
        list(model.named_parameters()), None, None, shardings(model), 1, None, torch.device("cpu")
    ).load(tmp_path / "ckpt" / "step-00000002")
    with torch.no_grad():
        hidden = model.hidden_states(tokens, torch.arange(tokens.size(1)))
        ours = torch.nn.functional.linear(hidden, model.head.weight)
        theirs = exported(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
