"""`ctxlaunch calibrate SPEC --submit` on target slurm: the spec's own batch script, with the
calibration as its one task, submitted to the real Slurm cluster running here; the job writes
the machine profile and ends COMPLETED. No timing is asserted."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from ctxlaunch.contract.spec import PROFILE_FORMAT
from ctxlaunch.perf.machine import load_profile
from tests.helpers.services import require_slurm
from tests.helpers.slurm_jobs import CTXLAUNCH, QUICK, run, wait_for

from .conftest import JOBS

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_calibration_job_through_slurm_writes_the_profile(tmp_path: Path) -> None:
    require_slurm()
    home = tmp_path / "home"
    profile = tmp_path / "team" / "cpu-ib.json"
    args = [
        CTXLAUNCH,
        "calibrate",
        str(JOBS / "demo.yaml"),
        "--submit",
        "--profile-out",
        str(profile),
    ]
    for item in [*QUICK, f"name=calib-{uuid.uuid4().hex[:8]}"]:
        args += ["--set", item]
    result = run(args, home, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.strip().splitlines()[-1]
    assert job_id.isdigit(), result.stdout + result.stderr
    script = next((home / "jobs").iterdir()).glob("*.sbatch")
    text = next(script).read_text()
    assert (
        "-m ctxlaunch.runtime.calibrate --out" in text and "ctxlaunch.runtime.trainer" not in text
    )
    assert "'--ntasks-per-node=1'" in text
    final = wait_for(
        home, tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=840
    )
    assert final["state"] == "COMPLETED", final
    data = json.loads(profile.read_text())
    assert (data["format"], data["gpu"], data["nodes"]) == (PROFILE_FORMAT, "cpu", 1)
    assert load_profile(profile).matmul_flops_per_second > 0
