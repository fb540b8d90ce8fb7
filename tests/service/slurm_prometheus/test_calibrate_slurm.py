"""`ctxlaunch calibrate SPEC --submit` on target slurm: the calibration job is a Python function
whose return value is the machine profile, so it goes to the real Slurm cluster running here
through submitit's executor, with the spec's resources and environment; the job writes the
profile on the shared filesystem, and submitit hands the same profile back as the job's result.
No timing is asserted."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from ctxlaunch.contract.spec import PROFILE_FORMAT
from ctxlaunch.perf.machine import load_profile
from tests.helpers.paths import JOBS
from tests.helpers.services import require_slurm
from tests.helpers.slurm_jobs import CTXLAUNCH, QUICK, run, wait_for

pytestmark = pytest.mark.service_group("slurm_host")


@pytest.mark.timeout(900)
def test_calibration_job_through_slurm_writes_the_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    (record_dir,) = (home / "jobs").iterdir()
    # submitit wrote and submitted its own batch script: one task, the job's environment
    # exported first, the pickled call run by submitit's runner; never the trainer.
    script = (record_dir / f"{job_id}_submission.sh").read_text()
    assert "submitit.core._submit" in script and "ctxlaunch.runtime.trainer" not in script
    assert "#SBATCH --ntasks-per-node=1" in script and "export PYTHONUNBUFFERED=1" in script
    assert "#SBATCH --time=10:00" in script  # the spec's own time limit
    final = wait_for(home, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=840)
    assert final["state"] == "COMPLETED", final
    data = json.loads(profile.read_text())
    assert (data["format"], data["gpu"], data["nodes"]) == (PROFILE_FORMAT, "cpu", 1)
    assert load_profile(profile).matmul_flops_per_second > 0
    # The function's return value, read back through submitit, is the same profile.
    from ctxlaunch.launch import jobstore
    from ctxlaunch.launch.backends.slurm import SlurmBackend

    monkeypatch.setenv("CTXLAUNCH_HOME", str(home))
    assert SlurmBackend().result(jobstore.load(record_dir.name)) == data
