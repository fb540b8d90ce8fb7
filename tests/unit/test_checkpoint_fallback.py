"""A damaged newest checkpoint does not stop a job for good: resume checks each committed step
against the sizes and SHA-256s its marker recorded at commit time, skips (and keeps) the one
that differs, says so in the log and the events, and resumes from the newest intact step. The
checkpoints are the real trainer's, of a tiny Llama."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ctxlaunch.contract import events
from tests.helpers.checkpoints import tiny_job, train

MARKER = "COMMITTED"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job trained 4 steps with a checkpoint at steps 2 and 4 (once for the module)."""
    root = tmp_path_factory.mktemp("trained")
    result = train(tiny_job(root, steps=4, interval=2), root / "run")
    assert result.returncode == 0, result.stderr
    return root


@pytest.fixture
def two_steps(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained job for one test to damage: its model, checkpoints and spec
    (naming the copy's own directories)."""
    for name in ("model", "checkpoints"):
        shutil.copytree(trained / name, tmp_path / name)
    spec = (trained / "job.yaml").read_text()
    (tmp_path / "job.yaml").write_text(spec.replace(str(trained), str(tmp_path)))
    return tmp_path


def data_file(step: Path) -> Path:
    return next(p for p in sorted(step.rglob("*")) if p.is_file() and p.suffix == ".distcp")


def test_the_marker_records_every_file(two_steps: Path) -> None:
    step = two_steps / "checkpoints" / "step-00000004"
    recorded = json.loads((step / MARKER).read_text())["files"]
    on_disk = sorted(
        str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != MARKER
    )
    assert sorted(recorded) == on_disk
    size, sha = recorded[str(data_file(step).relative_to(step))]
    assert size == data_file(step).stat().st_size and len(sha) == 64


def test_a_damaged_newest_step_is_skipped_kept_and_told(two_steps: Path) -> None:
    newest = two_steps / "checkpoints" / "step-00000004"
    damaged = data_file(newest)
    with damaged.open("r+b") as stream:  # same size, one byte changed: only the hash sees it
        first = stream.read(1)
        stream.seek(0)
        stream.write(bytes([first[0] ^ 0xFF]))
    run = two_steps / "run2"
    result = train(two_steps / "job.yaml", run, "training.steps=6")
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert f"skipped checkpoint {newest}" in out and "SHA-256 differs" in out
    assert "resumed from " + str(two_steps / "checkpoints" / "step-00000002") in out
    assert newest.is_dir() and damaged.is_file()  # kept for a person to look at
    skipped = [e for e in events.read_events(run) if e.kind == events.CHECKPOINT_SKIPPED]
    assert [e.get("step") for e in skipped] == [4]
    assert str(damaged) in str(skipped[0].get("reason"))


def test_every_step_damaged_fails_in_one_sentence(two_steps: Path) -> None:
    for step in ("step-00000002", "step-00000004"):
        data_file(two_steps / "checkpoints" / step).write_bytes(b"")
    result = train(two_steps / "job.yaml", two_steps / "run2", "training.steps=6")
    assert result.returncode == 1
    assert "every committed checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_cut_short_step_whose_marker_predates_the_file_list_is_skipped(
    two_steps: Path,
) -> None:
    """A marker written before markers recorded the files (no "files") cannot be compared with
    them: the step's data files are checked against what its metadata places in them, so a
    newest step cut short is skipped (every rerun failed) and the job resumes from step 2."""
    newest = two_steps / "checkpoints" / "step-00000004"
    marker = json.loads((newest / MARKER).read_text())
    del marker["files"]
    (newest / MARKER).write_text(json.dumps(marker))
    damaged = data_file(newest)
    damaged.write_bytes(damaged.read_bytes()[:100])
    run = two_steps / "run3"
    result = train(two_steps / "job.yaml", run, "training.steps=6")
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert f"skipped checkpoint {newest}" in out and f"{damaged} is cut short" in out
    assert "resumed from " + str(two_steps / "checkpoints" / "step-00000002") in out
