"""A hostile or broken config.json under model.init_from ends in one sentence naming the file
and the key, exit 2 from the command line, never a traceback, a hang or a MemoryError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ctxlaunch.contract.loader import SpecError, validate_spec
from tests.helpers.paths import ROOT

BASE_SPEC: dict[str, Any] = {
    "name": "hostile",
    "model": {"dtype": "fp32"},
    "training": {"seq_len": 64, "micro_batch": 1, "global_batch": 1, "steps": 1},
    "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
}


def llama_config() -> dict[str, Any]:
    """A tiny Llama's config.json as transformers writes it."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    return config.to_dict()


def spec_at(directory: Path) -> dict[str, Any]:
    return {**BASE_SPEC, "model": {**BASE_SPEC["model"], "init_from": str(directory)}}


def deep(levels: int) -> str:
    return '{"model_type": "llama", "x": ' + "[" * levels + "]" * levels + "}"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"rope_theta": None}, "rope_theta must be a number, got None"),
        ({"rms_norm_eps": None}, "rms_norm_eps must be a number, got None"),
        ({"rope_theta": [10000.0]}, "rope_theta must be a number"),
        ({"rope_theta": -1.0}, "rope_theta must be a positive number"),
        ({"head_dim": "32"}, "head_dim must be an integer, got '32'"),
        ({"hidden_size": True}, "missing or non-integer hidden_size"),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": "32",
                }
            },
            "original_max_position_embeddings must be a number",
        ),
    ],
)
def test_mistyped_keys_are_named(change: dict, words: str, tmp_path: Path) -> None:
    config = llama_config()
    config.pop("rope_parameters", None)
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError) as caught:
        validate_spec(spec_at(tmp_path))
    assert words in str(caught.value) and "config.json" in str(caught.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_attention_heads", 0),
        ("num_attention_heads", -4),
        ("num_key_value_heads", 0),
        ("head_dim", 0),
        ("hidden_size", 0),
    ],
)
def test_a_size_of_zero_or_less_is_named(key: str, value: int, tmp_path: Path) -> None:
    """num_attention_heads 0 divided by zero (a traceback); num_key_value_heads or head_dim 0
    silently became the default, a model transformers would build otherwise."""
    config = llama_config()
    config.pop("rope_parameters", None)
    config.pop("head_dim", None)  # so that the head count divides the width
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError) as caught:
        validate_spec(spec_at(tmp_path))
    assert f"{key} = {value}: a model's sizes are positive" in str(caught.value)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "deep", "huge", "directory", "not-utf8"])
def test_unreadable_config_json_is_refused_without_reading_it_all(
    kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)  # reading it would wait for a writer forever
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "deep":
        path.write_text(deep(100_000))
    elif kind == "huge":
        path.write_text(" " * (5 << 20) + "{}")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b'{"model_type": "\xff"}')
    words = {
        "fifo": "is a FIFO",
        "dev-zero": "is a device",
        "deep": "nested deeper",
        "huge": "larger than",
        "directory": "is a directory",
        "not-utf8": "not UTF-8",
    }[kind]
    with pytest.raises(SpecError) as caught:
        validate_spec(spec_at(tmp_path))
    assert words in str(caught.value) and "config.json" in str(caught.value)


def test_the_command_line_says_one_sentence_and_exits_2(tmp_path: Path) -> None:
    config = llama_config()
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": None}))
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(spec_at(tmp_path)))
    done = subprocess.run(
        [sys.executable, "-c", "from ctxlaunch.cli import main; main()", "validate", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")},
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "rope_theta must be a number" in done.stderr
