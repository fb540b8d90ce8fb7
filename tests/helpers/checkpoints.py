"""Checkpoints of the tiny Hugging Face Llama (tiny_hf.py) written by the real trainer, and the
hostile versions of them the checkpoint tests read: a pickle that runs a command, files cut
short or missing."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.paths import free_port
from tests.helpers.tiny_hf import tiny_spec, write_tiny_llama

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
"""The console script of the Python running the tests (it imports the code under test)."""


def run_ctxlaunch(
    *args: str, timeout: float = 240, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """`ctxlaunch ARGS` as a user runs it, its output captured."""
    return subprocess.run(
        [CTXLAUNCH, *args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )


def tiny_job(
    root: Path, *, steps: int = 2, interval: int | None = None, zero_stage: int = 0
) -> Path:
    """root/model (the tiny Llama), root/job.yaml training it `steps` steps with a checkpoint
    every `interval` (default: at the end) into root/checkpoints; returns the spec's path.
    zero_stage >= 1 trains with DeepSpeed (its own checkpoint format)."""
    if not (root / "model" / "config.json").is_file():
        write_tiny_llama(root / "model")
    data = tiny_spec(root / "model", root / "checkpoints", steps=steps)
    data["training"]["checkpoint"]["interval"] = interval or steps
    data["training"]["checkpoint"]["keep"] = 4
    if zero_stage:
        data["training"]["zero_stage"] = zero_stage
        data["training"]["engine"] = "deepspeed"
    spec = root / "job.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
"""What torchrun (or a rank set up in-process) sets, which would make a lone rank think it is one
of many."""


def lone_rank_env() -> dict[str, str]:
    """The environment for one rank of the trainer: one rank, whatever an in-process test of
    this worker left in the environment; and a port of its own (the default 29500 may be
    another test's rendezvous at the moment)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["MASTER_PORT"] = str(free_port())
    return env


def train(spec: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """One rank of the trainer on `spec` (what torchrun starts), to the end."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    return run_ctxlaunch("train", str(spec), *sets, "--run-dir", str(run_dir), env=lone_rank_env())


class RunsCommand:
    """Unpickled, it runs `touch MARKER`: the classic malicious pickle (`__reduce__` naming
    os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def plant_pickle(path: Path, marker: Path) -> None:
    """Replace `path` (a DCP .metadata) by a plain pickle that runs `touch marker`."""
    path.write_bytes(pickle.dumps(RunsCommand(marker)))


def plant_in_torch_file(path: Path, marker: Path) -> None:
    """Add an entry that runs `touch marker` to a torch.save file (a DeepSpeed state file),
    keeping everything else as it was."""
    import torch

    state = torch.load(path, weights_only=False)  # our own file, written by the trainer
    state["planted"] = RunsCommand(marker)
    torch.save(state, path)
