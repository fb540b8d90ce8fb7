"""The image probe and `ctxlaunch image check`. No container runtime answers here (a docker
client without a dockerd), so the probe itself runs in this venv (the environment an image is
built from); tests/service/kubernetes_api/test_image_pod.py sends the one-off pod to the real
API server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxlaunch.contract.loader import load_spec
from ctxlaunch.launch import image
from tests.helpers.paths import JOBS

BIN = Path(sys.executable).parent
CTXLAUNCH = str(BIN / "ctxlaunch")
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", image.PROBE_MODULE, *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_probe_passes_in_this_venv_without_nccl_and_names_what_a_gpu_image_lacks() -> None:
    """This venv has the CPU build of torch 2.13.0: everything but NCCL is there."""
    cpu = probe("--no-nccl")
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    lines = cpu.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["ok torch", "ok entrypoint", "ok train"]
    assert "torch 2.13.0" in lines[0]
    gpu = probe()
    assert gpu.returncode == 1
    assert "FAIL nccl: RuntimeError: torch 2.13.0+cpu is built without NCCL" in gpu.stdout
    assert probe("--bogus").returncode == 2


def test_probe_fails_when_the_entry_point_is_missing(tmp_path: Path) -> None:
    """An environment without the ctxlaunch console script on PATH fails `train`."""
    result = subprocess.run(
        [sys.executable, "-m", image.PROBE_MODULE, "--no-nccl"],
        env={**os.environ, "PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "FAIL train: RuntimeError: no ctxlaunch on PATH" in result.stdout


def ctx(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CTXLAUNCH, *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_image_check_local_exit_statuses() -> None:
    cpu = ctx("image", "check", str(JOBS / "demo.yaml"), "--via", "local")
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    assert "can start the trainer" in cpu.stderr
    gpu = ctx("image", "check", str(JOBS / "llama3-70b-1m-k8s.yaml"), "--via", "local")
    assert gpu.returncode == 1 and "FAIL nccl" in gpu.stdout
    assert "cannot start the trainer" in gpu.stderr


def test_image_check_refuses_a_spec_without_an_image_and_a_missing_runtime() -> None:
    bare = ctx("image", "check", str(JOBS / "demo.yaml"))
    assert bare.returncode == 2 and "cluster.kubernetes.image is not set" in bare.stderr
    if image.local_runtime() is not None:
        pytest.skip("a container runtime answers here")
    none = ctx(
        "image",
        "check",
        str(JOBS / "demo.yaml"),
        "--via",
        "runtime",
        "--set",
        "cluster.kubernetes.image=example/ctxlaunch:1",
    )
    assert none.returncode == 1 and "no container runtime answers here" in none.stderr


def test_runtime_commands_run_the_probe_as_the_entry_point() -> None:
    spec = load_spec(JOBS / "llama3-70b-1m-k8s.yaml")
    args = image.probe_args(spec)
    assert args == []
    assert image.runtime_command("docker", "img:1", args) == [
        "docker",
        "run",
        "--rm",
        "--entrypoint",
        "python3",
        "img:1",
        "-m",
        image.PROBE_MODULE,
    ]
    assert image.runtime_command("nerdctl", "img:1", ["--no-nccl"])[:3] == [
        "nerdctl",
        "--namespace",
        "k8s.io",
    ]


def test_the_dockerfile_the_probe_and_setup_pin_the_same_torch() -> None:
    """No image can be built here (no registry, no daemon): the pins must agree instead."""
    import re

    from ctxlaunch.runtime.imageprobe import TORCH_VERSION
    from tests.helpers.paths import ROOT

    dockerfile = (ROOT / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM pytorch/pytorch:(\S+)$", dockerfile, re.M)
    assert base.startswith(TORCH_VERSION + "-cuda")
    assert f'"torch=={TORCH_VERSION}"' in dockerfile
    setup = (ROOT / "scripts" / "setup").read_text()
    assert f"TORCH_VERSION={TORCH_VERSION}\n" in setup
    assert re.search(r"^COPY templates ", dockerfile, re.M), "the wheel needs the templates"
