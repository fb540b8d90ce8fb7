"""The package as a user gets it: the wheel's contents and metadata, and (marked distributed:
minutes) the built wheel installed into a fresh virtual environment, then each extra added to
it in turn (data, report, then train, the one that brings torch), each extra's commands run
from a folder outside the repository once it is installed, and the base commands before any.

The environments install through pip with torch constrained to the one version the project
runs (2.13.0); the wheel is built once, without build isolation, as tests/unit/test_render.py
builds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

from ctxlaunch import __version__
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.tiny_hf import tiny_spec, write_tiny_llama

TORCH_PIN = "torch==2.13.0"
SHARED = {
    "ctxlaunch/share/grafana/ctxlaunch-training.json": ROOT
    / "manifests/grafana/ctxlaunch-training.json",
    "ctxlaunch/share/prometheus/ctxlaunch-rules.yml": ROOT
    / "manifests/prometheus/ctxlaunch-rules.yml",
    **{f"ctxlaunch/share/jobs/{p.relative_to(JOBS)}": p for p in JOBS.rglob("*.yaml")},
}
"""Each data file the wheel carries -> the repository file it is."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once per module."""
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return next(out.glob("ctxlaunch-*.whl"))


def test_the_wheel_carries_the_data_files_the_license_and_the_types(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    for packaged, source in SHARED.items():
        assert archive.read(packaged) == source.read_bytes(), packaged
    assert "ctxlaunch/py.typed" in names and "ctxlaunch/templates/slurm.sbatch.j2" in names
    dist_info = f"ctxlaunch-{__version__}.dist-info"
    assert archive.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    metadata = archive.read(f"{dist_info}/METADATA").decode()
    headers = [line for line in metadata.splitlines() if ": " in line]
    assert f"Version: {__version__}" in headers and "License-Expression: Apache-2.0" in headers
    assert "Classifier: Typing :: Typed" in headers
    extras = {line.split(": ", 1)[1] for line in headers if line.startswith("Provides-Extra")}
    assert {
        "train",
        "data",
        "report",
        "tensorboard",
        "mlflow",
        "wandb",
        "trackers",
        "docs",
        "kubernetes",
    } <= extras
    base = [line for line in headers if line.startswith("Requires-Dist") and "extra ==" not in line]
    assert not [line for line in base if "torch" in line or "numpy" in line], base


def test_the_image_build_context_holds_what_the_wheel_is_built_from() -> None:
    """The Dockerfile builds the wheel (`pip install .[train]`): every file pyproject.toml puts
    into it must be copied in, and not left out of the build context by .dockerignore."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel_target = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    sources = [*wheel_target["force-include"], *pyproject["project"]["license-files"]]
    sources += [*wheel_target["packages"], "pyproject.toml", pyproject["project"]["readme"]]
    copied = [
        word
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
        for word in line.split()[1:-1]
    ]
    ignored = (ROOT / ".dockerignore").read_text().split()
    for source in sources:
        top = source.split("/")[0]
        assert top in copied, f"the Dockerfile does not COPY {top} (the wheel needs {source})"
        assert top not in ignored, f".dockerignore leaves out {top} (the wheel needs {source})"


# -- installed: the base, then each extra added to the same environment ------------------------
def make_venv(tmp_path: Path) -> Path:
    """A fresh virtual environment; returns its bin/."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    return venv / "bin"


def install(bin_dir: Path, wheel: Path, extra: str) -> None:
    """Install the wheel (with `extra`) into the environment of `bin_dir`."""
    constraints = bin_dir.parent / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    installed = subprocess.run(
        [
            str(bin_dir / "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            # No byte-compiling of every installed module (torch's alone takes most of the
            # install): the commands compile what they import.
            "--no-compile",
            "-c",
            str(constraints),
            target,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "DS_BUILD_OPS": "0"},  # DeepSpeed's ops build just in time
    )
    assert installed.returncode == 0, installed.stderr[-4000:]


class Installed:
    """Run the installed console script from `cwd` (outside the repository), with its own
    CTXLAUNCH_HOME and nothing of this checkout on the path."""

    def __init__(self, bin_dir: Path, cwd: Path):
        self.bin_dir, self.cwd = bin_dir, cwd
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env |= {"CTXLAUNCH_HOME": str(cwd / "home"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def __call__(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin_dir / "ctxlaunch"), *args],
            capture_output=True,
            text=True,
            cwd=self.cwd,
            env=self.env,
            timeout=600,
        )
        assert result.returncode == code, (args, result.stdout[-2000:], result.stderr[-4000:])
        assert "Traceback" not in result.stderr, result.stderr
        return result

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "python"), "-c", code],
            capture_output=True,
            text=True,
            cwd=self.cwd,
            env=self.env,
            timeout=120,
        )


def check_base(ctxlaunch: Installed) -> None:
    where = ctxlaunch.python("import ctxlaunch; print(ctxlaunch.__file__)").stdout
    assert "site-packages" in where and str(ROOT) not in where
    assert ctxlaunch.python("import torch").returncode != 0  # the base install has no torch
    assert ctxlaunch.python("import kubernetes").returncode != 0  # nor the Kubernetes client
    assert ctxlaunch("--version").stdout.strip() == f"ctxlaunch {__version__}"
    names = [line.split()[0] for line in ctxlaunch("examples").stdout.splitlines()]
    assert "llama3-8b-128k-slurm" in names and "sweeps/demo" in names
    ctxlaunch("examples", "-o", "examples")
    spec = "examples/llama3-8b-128k-slurm.yaml"
    assert json.loads(ctxlaunch("validate", spec, "--json").stdout)["ok"] is True
    assert json.loads(ctxlaunch("plan", spec, "--json").stdout)["memory"]["fits"] is True
    assert ctxlaunch("render", spec).stdout.startswith("#!/bin/bash")
    ctxlaunch("render", "examples/llama3-70b-1m-k8s.yaml", "-o", "rendered")
    assert (ctxlaunch.cwd / "rendered" / "llama3-70b-1m.yaml").is_file()
    assert ctxlaunch("sweep", "examples/sweeps/demo.yaml", "--dry-run", "--json").stdout
    dashboard = ROOT / "manifests/grafana/ctxlaunch-training.json"
    assert ctxlaunch("dashboard").stdout == dashboard.read_text()
    assert (
        ctxlaunch("alerts").stdout
        == (ROOT / "manifests/prometheus/ctxlaunch-rules.yml").read_text()
    )
    missing = ctxlaunch("train", "examples/demo.yaml", code=2)
    assert "ctxlaunch train needs torch: pip install 'ctxlaunch[train]'" in missing.stderr
    missing = ctxlaunch("submit", "examples/demo.yaml", code=2)
    assert "pip install 'ctxlaunch[train]'" in missing.stderr


def check_data(ctxlaunch: Installed) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "The quick brown fox jumps over the lazy dog. " * 40
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    )
    tokenizer.save(str(ctxlaunch.cwd / "tokenizer.json"))
    (ctxlaunch.cwd / "doc.txt").write_text(text)
    result = ctxlaunch("data", "prepare", "doc.txt", "-t", "tokenizer.json", "-o", "tokens")
    assert "1 documents" in result.stdout
    assert (ctxlaunch.cwd / "tokens.bin").stat().st_size > 0
    assert (ctxlaunch.cwd / "tokens.idx").is_file()


def check_train(ctxlaunch: Installed) -> None:
    source = ctxlaunch.cwd / "hf"
    tensors = write_tiny_llama(source)
    spec = ctxlaunch.cwd / "tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(source, ctxlaunch.cwd / "ckpt", steps=1)))
    trained = ctxlaunch("train", "tiny.yaml", "--run-dir", "run")
    assert "step 1/1" in trained.stdout
    exported = ctxlaunch("export", "ckpt", "--hf", "exported")
    assert "export: tensors written: 100%" in exported.stderr
    index = json.loads((ctxlaunch.cwd / "exported" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == tensors


def check_report(ctxlaunch: Installed) -> None:
    from ctxlaunch.contract.loader import load_spec

    spec = load_spec(JOBS / "demo.yaml").model_dump(mode="json")
    point = {"index": 0, "name": "demo", "values": {}, "job": None, "skipped": "x", "spec": spec}
    record = {"id": "s1", "name": "s", "target": "local", "axes": [], "points": [point]}
    sweeps = ctxlaunch.cwd / "home" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "s1.json").write_text(json.dumps(record))
    ctxlaunch("report", "s1", "--plots", "plots")
    assert sorted(p.name for p in (ctxlaunch.cwd / "plots").iterdir()) == [
        "memory.png",
        "mfu.png",
        "throughput.png",
    ]


CHECKS = {"": check_base, "data": check_data, "report": check_report, "train": check_train}
"""Each extra's commands, in the order the extras are added (train last: the base's and the
other extras' checks run without torch installed)."""


@pytest.mark.distributed
@pytest.mark.timeout(1800)
def test_each_extra_installed_from_the_wheel_runs_its_commands(wheel: Path, tmp_path: Path) -> None:
    bin_dir = make_venv(tmp_path)
    for extra, check in CHECKS.items():
        install(bin_dir, wheel, extra)
        work = tmp_path / f"work-{extra or 'base'}"
        work.mkdir()
        check(Installed(bin_dir, work))
