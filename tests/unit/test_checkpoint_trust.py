"""Reading a checkpoint never runs code from it: torch.distributed.checkpoint's `.metadata` and
DeepSpeed's state files replaced by pickles that run `touch MARKER` are refused by name by
`export`, `eval` and a resuming trainer, and MARKER never appears. The checkpoints are the real
trainer's, of a tiny Llama; the hostile pickle is the classic `__reduce__` naming os.system."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest

from tests.helpers.checkpoints import (
    RunsCommand,
    plant_in_torch_file,
    plant_pickle,
    run_ctxlaunch,
    tiny_job,
    train,
)


@pytest.fixture(scope="module")
def dcp_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny job trained 2 steps with torch.distributed.checkpoint (ZeRO-0)."""
    root = tmp_path_factory.mktemp("dcp")
    spec = tiny_job(root)
    result = train(spec, root / "run")
    assert result.returncode == 0, result.stderr
    return root


@pytest.fixture(scope="module")
def deepspeed_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job trained with DeepSpeed ZeRO-1 (its own checkpoint format)."""
    root = tmp_path_factory.mktemp("deepspeed")
    spec = tiny_job(root, zero_stage=1)
    result = train(spec, root / "run")
    assert result.returncode == 0, result.stderr
    return root


def hostile_copy(job: Path, tmp_path: Path) -> Path:
    """A copy of the job's directory (model, spec, checkpoints) to plant things in."""
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    spec = copy / "job.yaml"
    spec.write_text(spec.read_text().replace(str(job), str(copy)))
    return copy


def test_dcp_metadata_that_runs_a_command_is_refused_and_never_run(
    dcp_job: Path, tmp_path: Path
) -> None:
    job = hostile_copy(dcp_job, tmp_path)
    marker = tmp_path / "PLANTED-COMMAND-RAN"
    step = job / "checkpoints" / "step-00000002"
    plant_pickle(step / ".metadata", marker)

    exported = run_ctxlaunch("export", str(step), "--hf", str(tmp_path / "hf"))
    assert exported.returncode == 2, exported.stderr
    assert f"{step / '.metadata'}: refused" in exported.stderr
    assert "posix.system" in exported.stderr and "Traceback" not in exported.stderr
    assert not (tmp_path / "hf").exists()

    evaluated = run_ctxlaunch(
        "eval",
        str(job / "job.yaml"),
        "--checkpoint",
        str(step),
        "--set",
        "training.eval.sequences=1",
    )
    assert evaluated.returncode == 2, evaluated.stderr
    assert "refused" in evaluated.stderr and "Traceback" not in evaluated.stderr

    train(job / "job.yaml", job / "run2", "training.steps=3")
    assert not marker.exists(), "a checkpoint ran the command planted in it"


def test_deepspeed_state_that_runs_a_command_is_refused_and_never_run(
    deepspeed_job: Path, tmp_path: Path
) -> None:
    job = hostile_copy(deepspeed_job, tmp_path)
    marker = tmp_path / "PLANTED-COMMAND-RAN"
    step = job / "checkpoints" / "step-00000002"
    optim = next(step.glob("*optim_states.pt"))
    plant_in_torch_file(optim, marker)

    exported = run_ctxlaunch("export", str(step), "--hf", str(tmp_path / "hf"))
    assert exported.returncode == 2, exported.stderr
    assert f"{optim}: refused" in exported.stderr and "posix.system" in exported.stderr
    assert not (tmp_path / "hf").exists()

    train(job / "job.yaml", job / "run2", "training.steps=3")
    assert not marker.exists(), "a DeepSpeed checkpoint ran the command planted in it"

    model_states = next(step.glob("*model_states.pt"))
    plant_in_torch_file(model_states, marker)
    evaluated = run_ctxlaunch(
        "eval",
        str(job / "job.yaml"),
        "--checkpoint",
        str(step),
        "--set",
        "training.eval.sequences=1",
    )
    assert evaluated.returncode == 2, evaluated.stderr
    assert not marker.exists()


def test_genuine_metadata_reads_as_torch_reads_it(dcp_job: Path) -> None:
    """The allow-list holds everything a real checkpoint's metadata needs: the same entries,
    sizes and dtypes as torch's own (unrestricted) reader finds."""
    from ctxlaunch.runtime.checkpointing.safe_unpickle import read_metadata_file

    path = dcp_job / "checkpoints" / "step-00000002" / ".metadata"
    ours = read_metadata_file(path)
    theirs = pickle.loads(path.read_bytes())  # our own trainer's file: trusted here
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for key, meta in theirs.state_dict_metadata.items():
        assert repr(ours.state_dict_metadata[key]) == repr(meta), key


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "eval"),
        ("os", "system"),
        ("subprocess", "Popen"),
        ("torch", "load"),
        ("torch.distributed.checkpoint.metadata", "dataclass"),
        ("pathlib", "Path"),
    ],
)
def test_any_other_global_is_refused_by_name(module: str, name: str) -> None:
    from ctxlaunch.runtime.checkpointing.safe_unpickle import CheckpointRefused, load_metadata

    payload = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b")R."
    with pytest.raises(CheckpointRefused, match=rf"ckpt/.metadata: refused: .*{module}\.{name}"):
        load_metadata(io.BytesIO(payload), "ckpt/.metadata")


def test_damaged_metadata_is_a_sentence_naming_the_file() -> None:
    from ctxlaunch.runtime.checkpointing.safe_unpickle import load_metadata

    whole = pickle.dumps({"a": 1})
    with pytest.raises(ValueError, match="m/.metadata: not a torch.distributed.checkpoint"):
        load_metadata(io.BytesIO(whole[:-3]), "m/.metadata")
    with pytest.raises(ValueError, match="it holds a dict"):
        load_metadata(io.BytesIO(whole), "m/.metadata")


def test_weights_only_load_names_the_global(tmp_path: Path) -> None:
    import torch

    from ctxlaunch.runtime.checkpointing.safe_unpickle import CheckpointRefused, weights_only_load

    path = tmp_path / "state.pt"
    torch.save({"weights": torch.ones(2), "planted": RunsCommand(tmp_path / "ran")}, path)
    with pytest.raises(CheckpointRefused, match=r"state.pt: refused: loading it would call posix"):
        weights_only_load(str(path), where=path)
    assert not (tmp_path / "ran").exists()
    torch.save({"weights": torch.ones(2)}, path)
    assert torch.equal(weights_only_load(str(path))["weights"], torch.ones(2))


def test_deepspeed_is_imported_only_for_a_file_that_names_it(
    deepspeed_job: Path, tmp_path: Path
) -> None:
    """A fresh interpreter reads a plain torch file without importing DeepSpeed (seconds of CPU
    a ZeRO-0 or FSDP2 resume should not pay), then reads DeepSpeed's optimizer state, whose
    pickle names DeepSpeed's classes, from a path and from bytes: both load, DeepSpeed now
    imported."""
    import subprocess
    import sys

    import torch

    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.ones(2)}, plain)
    (optim,) = (deepspeed_job / "checkpoints").glob("step-*/*optim_states.pt")
    script = f"""
import io, sys
from ctxlaunch.runtime.checkpointing.safe_unpickle import weights_only_load
assert weights_only_load({str(plain)!r})["weights"].sum() == 2
assert "deepspeed" not in sys.modules, "a plain file imported DeepSpeed"
state = weights_only_load({str(optim)!r}, map_location="cpu")
assert "deepspeed" in sys.modules
again = weights_only_load(io.BytesIO(open({str(optim)!r}, "rb").read()), map_location="cpu")
assert state.keys() == again.keys() and state.keys(), state.keys()
print("ok", sorted(state))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("ok ["), done.stdout
