"""`ctxlaunch init`: a commented spec that validates, from a saved transformers model directory,
a sequence length and the cluster found; a hub id answered without the network; the cluster
tools' answers read right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import load_spec
from ctxlaunch.launch.discover import gpu_type, parse_kubectl_nodes, parse_sinfo
from tests.helpers.cli import CliRunner
from tests.helpers.tiny_hf import write_tiny_llama

runner = CliRunner()


def test_init_on_a_transformers_directory_writes_a_spec_that_validates(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    write_tiny_llama(model)
    out = tmp_path / "spec.yaml"
    args = ["init", str(model), "--seq-len", "2048", "--target", "local", "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    text = out.read_text()
    assert text.startswith("# Written by `ctxlaunch init`.")
    assert "# The shape, RoPE and window come from init_from's config.json" in text
    assert "# From the layout `ctxlaunch advise` ranks first: " in text
    spec = load_spec(out)
    assert spec.model.init_from == str(model.resolve()) and spec.training.seq_len == 2048
    assert spec.cluster.target == "local" and spec.cluster.gpu in ("cpu", "H100")
    assert yaml.safe_load(text)["name"] == "tiny-llama-2k"
    # The layout is the one advise ranks first for that spec.
    advised = json.loads(runner.invoke(app, ["advise", str(out), "--json", "--top", "1"]).stdout)
    assert advised["ranked"][0]["rank"] in ("1", "=1")
    assert advised["own_layout"]["step_seconds"] == pytest.approx(
        advised["ranked"][0]["step_seconds"], rel=1e-9
    )
    # A file that exists is not overwritten without --force.
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "exists; pass --force" in again.stderr
    assert runner.invoke(app, [*args, "--force", "--json"]).exit_code == 0


@pytest.mark.parametrize(
    "env, said",
    [
        ({"HF_HUB_OFFLINE": "1"}, "the hub is off here (HF_HUB_OFFLINE)"),
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub cannot be reached from here"),
    ],
    ids=["offline", "unreachable"],
)
def test_a_hub_id_without_the_hub_says_how_to_download_it(
    env: dict[str, str], said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never the network: the hub is off, or its address (HF_ENDPOINT) a closed local port."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(
        app, ["init", "meta-llama/Llama-3.1-8B", "--seq-len", "131072", "--target", "local"]
    )
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert said in message
    assert "download it with `hf download meta-llama/Llama-3.1-8B --local-dir DIR`" in message
    result = runner.invoke(app, ["init", "no-such-dir", "--seq-len", "1024", "--target", "local"])
    assert result.exit_code == 2 and "not a Hugging Face hub id" in result.stderr


def test_the_cluster_tools_are_read_right() -> None:
    """The text each tool prints, in the format `init` asks for (sinfo -o "%P %D %G";
    kubectl get nodes -o json, trimmed to the fields read)."""
    sinfo = "debug 2 (null)\ngpu* 16 gpu:h100:8(S:0-1)\nbig 4 gpu:a100:4\n"
    found = parse_sinfo(sinfo)
    assert found is not None and (found.target, found.gpu, found.nodes, found.gpus_per_node) == (
        "slurm",
        "H100",
        16,
        8,
    )
    assert found.settings == {"partition": "gpu"}
    assert parse_sinfo("batch 1 (null)\n") is None
    nodes = {
        "items": [
            {
                "metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
                "status": {"allocatable": {"nvidia.com/gpu": "8"}},
            }
        ]
        * 3
        + [{"metadata": {"labels": {}}, "status": {"allocatable": {"cpu": "64"}}}]
    }
    found = parse_kubectl_nodes(json.dumps(nodes))
    assert found is not None and (found.gpu, found.nodes, found.gpus_per_node) == ("H200", 3, 8)
    assert parse_kubectl_nodes('{"items": []}') is None
    assert [gpu_type(n) for n in ("NVIDIA A100-SXM4-40GB", "NVIDIA L40S", "Tesla T4")] == [
        "A100-40GB",
        "L40S",
        None,
    ]
