"""model.init_from's safetensors files are checked against the model at validation time, before
any rank starts, by their headers alone: what the model expects is transformers' own tensors,
and each damaged or disagreeing file ends in one sentence naming the file and the tensor."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ctxlaunch.contract.families import FAMILIES
from ctxlaunch.contract.loader import SpecError, validate_spec
from tests.helpers.hf_models import hf_config, save_hf
from tests.helpers.tiny_hf import write_tiny_llama

BASE_SPEC: dict[str, Any] = {
    "name": "weights",
    "model": {"dtype": "fp32"},
    "training": {"seq_len": 64, "micro_batch": 1, "global_batch": 1, "steps": 1},
    "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
}


def spec_at(directory: Path) -> dict[str, Any]:
    return {**BASE_SPEC, "model": {**BASE_SPEC["model"], "init_from": str(directory)}}


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, read as the format defines it."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])


def write_with_header(path: Path, header: dict[str, Any], data: bytes) -> None:
    """A safetensors file made by hand: a header the library itself would never write."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    ("family", "tied"),
    [("llama", False), ("llama", True), ("mistral", False), ("qwen2", True), ("qwen3", False)],
)
def test_expected_tensors_are_what_transformers_saves(
    family: str, tied: bool, tmp_path: Path
) -> None:
    """The names and shapes the check expects equal those transformers' save_pretrained writes
    for a model of each family (a tied model's file has no lm_head), and the spec validates."""
    save_hf(tmp_path, hf_config(family=family, tied=tied))
    saved = {
        name: tuple(entry["shape"])
        for name, entry in safetensors_header(tmp_path / "model.safetensors").items()
        if name != "__metadata__"
    }
    model = validate_spec(spec_at(tmp_path)).model
    assert FAMILIES[model.family].hf_tensors(model) == saved


def damage(case: str, directory: Path) -> str:
    """Damage the tiny Llama in `directory` as `case` says; returns the words the refusal must
    hold (besides the file's name)."""
    single = directory / "model.safetensors"
    raw = single.read_bytes()
    header = safetensors_header(single)
    (length,) = struct.unpack("<Q", raw[:8])
    data = raw[8 + length :]
    if case == "truncated":
        single.write_bytes(raw[: len(raw) - 4096])
        return "lies outside the file's"
    if case == "empty":
        single.write_bytes(b"")
        return "0 bytes, too short for a safetensors file"
    if case == "garbage":
        single.write_bytes(os.urandom(4096))
        return "its first bytes announce a header of"
    if case == "garbage header":
        single.write_bytes(struct.pack("<Q", 64) + os.urandom(64) + data)
        return "its header is not the JSON object of a safetensors file"
    if case == "header larger than the file":
        single.write_bytes(struct.pack("<Q", 1 << 60) + raw[8:])
        return "announce a header of 1,152,921,504,606,846,976 bytes"
    if case == "missing tensor":
        from safetensors.torch import load_file, save_file

        tensors = load_file(single)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, single)
        return "no tensor model.layers.1.mlp.up_proj.weight, which the model needs"
    if case == "shape":
        from safetensors.torch import load_file, save_file

        tensors = load_file(single)
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
        save_file(tensors, single)
        return "tensor model.layers.0.self_attn.k_proj.weight has shape [8, 32], the model"
    if case == "dtype":
        from safetensors.torch import load_file, save_file

        tensors = load_file(single)
        tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
        save_file(tensors, single)
        return "tensor model.norm.weight is I32, not a floating-point dtype"
    if case == "offsets outside the file":
        entry = header["model.norm.weight"]
        entry["data_offsets"] = [len(data) - 64, len(data) + 64]
        write_with_header(single, header, data)
        return "model.norm.weight's data, bytes"
    if case == "offsets disagree with the shape":
        begin, _ = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [begin, begin + 4]
        write_with_header(single, header, data)
        return (
            "tensor model.norm.weight is F32 of shape [32], 128 bytes, but its data_offsets hold 4"
        )
    if case == "a FIFO":
        single.unlink()
        os.mkfifo(single)  # reading it would wait for a writer forever
        return "not a regular file"
    raise AssertionError(case)


CASES = [
    "truncated",
    "empty",
    "garbage",
    "garbage header",
    "header larger than the file",
    "missing tensor",
    "shape",
    "dtype",
    "offsets outside the file",
    "offsets disagree with the shape",
    "a FIFO",
]


@pytest.mark.parametrize("case", CASES)
def test_damaged_weights_are_refused_at_validation_naming_file_and_tensor(
    case: str, tmp_path: Path
) -> None:
    write_tiny_llama(tmp_path)
    validate_spec(spec_at(tmp_path))  # intact: validates
    words = damage(case, tmp_path)
    with pytest.raises(SpecError) as caught:
        validate_spec(spec_at(tmp_path))
    text = str(caught.value)
    assert "model.init_from" in text and str(tmp_path / "model.safetensors") in text, text
    assert words in text, text


def sharded(directory: Path) -> tuple[Path, dict[str, str]]:
    """A tiny Llama saved by transformers in several shards, and its index's weight map."""
    save_hf(directory, hf_config(), max_shard_size="40KB")
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    return index, weight_map


@pytest.mark.parametrize(
    "case", ["missing shard", "tensor not in its shard", "shard outside", "not JSON"]
)
def test_a_damaged_sharded_checkpoint_is_refused_naming_the_index_or_shard(
    case: str, tmp_path: Path
) -> None:
    index, weight_map = sharded(tmp_path)
    validate_spec(spec_at(tmp_path))  # intact: validates
    name = "model.layers.1.mlp.down_proj.weight"
    shard = weight_map[name]
    if case == "missing shard":
        (tmp_path / shard).unlink()
        words = f"{index}: shard {shard} is missing"
    elif case == "tensor not in its shard":
        other = next(s for s in sorted(set(weight_map.values())) if s != shard)
        weight_map[name] = other
        index.write_text(json.dumps({"weight_map": weight_map}))
        words = f"{tmp_path / other}: no tensor {name}, which {index} says this shard holds"
    elif case == "shard outside":
        weight_map[name] = "../elsewhere.safetensors"
        index.write_text(json.dumps({"weight_map": weight_map}))
        words = "shard '../elsewhere.safetensors' is not a file name in the checkpoint's directory"
    else:
        index.write_text("{not json")
        words = f"{index}: model.safetensors.index.json is not valid JSON"
    with pytest.raises(SpecError) as caught:
        validate_spec(spec_at(tmp_path))
    assert words in str(caught.value), str(caught.value)


def test_the_command_line_refuses_before_any_rank_starts(tmp_path: Path) -> None:
    """`ctxlaunch validate`, `plan` and `submit` of a truncated checkpoint: exit 2 and one
    sentence naming the file and the tensor, no traceback, no rank started (no events file)."""
    checkpoint = tmp_path / "ckpt"
    write_tiny_llama(checkpoint)
    damage("truncated", checkpoint)
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(spec_at(checkpoint)))
    env = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")}
    for command in (["validate", str(spec)], ["plan", str(spec)], ["submit", str(spec)]):
        done = subprocess.run(
            [sys.executable, "-c", "from ctxlaunch.cli import main; main()", *command],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "[rank" not in done.stderr
        assert f"{checkpoint / 'model.safetensors'}: tensor model.layers." in " ".join(
            done.stderr.split()
        )
    assert not list(tmp_path.rglob("events.jsonl"))
