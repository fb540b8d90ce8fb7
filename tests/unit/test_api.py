"""ctxlaunch.api: the calls return results and raise their own errors, never printing or
exiting, and the example script of its page runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxlaunch import api
from tests.helpers.paths import JOBS, ROOT


def test_calls_return_results_and_print_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path))
    spec = JOBS / "llama3-8b-128k-slurm.yaml"
    job = api.load_spec(spec, ["training.steps=10"])
    assert job.training.steps == 10
    report = api.plan(job)
    assert report.fits and report.accounting is not None and report.accounting.steps == 10
    advice = api.advise(spec)
    assert advice.best is not None and advice.rank_by == "step"
    rendered = api.render(job)
    assert rendered.main == "llama3-8b-128k.sbatch" and rendered.text.startswith("#!/bin/bash")
    planned = api.submit(job, dry_run=True)
    assert planned.record is None and planned.dry_run.command[0] == "sbatch"
    built = api.build_spec("tiny", model={"preset": "tiny"}, training={"seq_len": 1024})
    assert built.name == "tiny"
    checked = api.validate({"name": "x", "model": {"preset": "tiny"}, "training": {"seq_len": 0}})
    assert not checked.ok and [p.path for p in checked.problems] == ["training.seq_len"]
    assert capsys.readouterr() == ("", "")


def test_each_error_is_raised_as_its_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path))
    with pytest.raises(api.SpecError) as bad:
        api.load_spec({"name": "x", "model": {"preset": "tiny"}, "training": {"seq_len": 0}})
    assert [p.path for p in bad.value.problems] == ["training.seq_len"]
    with pytest.raises(api.ApiError, match="a local job has nothing to render"):
        api.render(JOBS / "demo.yaml")
    with pytest.raises(api.ApiError, match="--rank-by cost: cluster.gpu_hour_price"):
        api.advise(JOBS / "llama3-8b-128k-slurm.yaml", rank_by="cost")
    with pytest.raises(api.JobNotFound, match="no job 'nope'"):
        api.status("nope")
    with pytest.raises(api.JobNotFound, match="no sweep or job 'nope'"):
        api.report("nope")


@pytest.mark.timeout(180)
def test_the_example_script_of_the_api_page_runs(tmp_path: Path) -> None:
    env = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "examples" / "api_tour.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=170,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("fits: ") and lines[1].startswith("the run: 954 steps")
    assert " GPUs  " in lines[2] and "cost" in lines[2]
    assert any(line.startswith("sbatch ") for line in lines)
    assert any(line.startswith("problem: name: 'Bad_Name'") for line in lines)
    assert not list(tmp_path.rglob("job.json"))  # nothing was submitted
