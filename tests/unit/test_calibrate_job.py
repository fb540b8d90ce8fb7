"""`ctxlaunch calibrate SPEC --submit`: the calibration as a real one-node job through the local
backend (torchrun running ctxlaunch.runtime.calibration.job, real torch and real gloo over 127.0.0.1),
the machine profile it writes, and cluster.profile naming it in plan. No timing is asserted:
this machine is shared and busy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import SpecError, load_spec
from ctxlaunch.contract.spec import PROFILE_FORMAT
from ctxlaunch.perf.machine import load_profile, machine_for
from ctxlaunch.perf.steptime import predict_spec
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS

runner = CliRunner()


@pytest.mark.timeout(600)
def test_submit_runs_a_local_job_and_plan_uses_its_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path / "home"))
    spec = tmp_path / "demo.yaml"
    spec.write_text((JOBS / "demo.yaml").read_text())
    result = runner.invoke(app, ["calibrate", str(spec), "--submit"])
    assert result.exit_code == 0, result.output
    profile = tmp_path / "profiles" / "cpu-infiniband-ndr.json"  # beside the spec, by default
    data = json.loads(profile.read_text())
    assert (data["format"], data["gpu"], data["fabric"]) == (
        PROFILE_FORMAT,
        "cpu",
        "infiniband-ndr",
    )
    calibration = load_profile(profile)
    assert calibration.matmul_flops_per_second > 0
    assert calibration.attention_flops_per_second > 0
    assert calibration.link_bytes_per_second > 0
    # The job left a record like any local job.
    records = list((tmp_path / "home" / "jobs").iterdir())
    assert len(records) == 1

    named = load_spec(spec, [f"cluster.profile={profile}"])
    assert named.cluster.profile == str(profile)
    machine = machine_for(named, saved=False)
    assert machine.peak_flops["fp32"] == calibration.machine(2).peak_flops["fp32"]
    assert predict_spec(named, machine).step_seconds == pytest.approx(
        predict_spec(named, calibration.machine(2)).step_seconds
    )
    # Without the profile (and nothing saved) the tables' placeholders time it: not the same.
    bare = load_spec(spec)
    assert machine_for(bare, saved=False).peak_flops["fp32"] != machine.peak_flops["fp32"]

    plan = runner.invoke(app, ["plan", str(spec), "--set", f"cluster.profile={profile}", "--json"])
    assert plan.exit_code == 0, plan.output
    step = json.loads(plan.stdout)["step_time"]["step_seconds"]
    assert step == pytest.approx(predict_spec(named, machine).step_seconds)


def _profile(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "format": PROFILE_FORMAT,
                "gpu": "cpu",
                "fabric": "infiniband-ndr",
                "calibration": {},
                **changes,
            }
        )
    )
    return path


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"gpu": "H200"}, "measured on gpu 'H200', but cluster.gpu is 'cpu'"),
        ({"fabric": "roce"}, "measured over fabric 'roce', but fabric.network is 'infiniband-ndr'"),
        ({"format": "something"}, "not a machine profile"),
    ],
)
def test_a_profile_that_does_not_match_is_named(
    tmp_path: Path, changes: dict[str, object], needle: str
) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(JOBS / "demo.yaml", [f"cluster.profile={_profile(tmp_path, **changes)}"])
    text = str(caught.value)
    assert "cluster.profile" in text and needle in text, text


def test_a_missing_profile_is_named(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["plan", str(JOBS / "demo.yaml"), "--set", f"cluster.profile={tmp_path / 'none.json'}"]
    )
    assert result.exit_code == 2
    assert "cluster.profile" in result.output and "no such file" in result.output


def test_submit_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path / "home"))
    result = runner.invoke(app, ["calibrate", "--submit"])
    assert result.exit_code == 2 and "give the SPEC" in result.output
    result = runner.invoke(
        app, ["calibrate", str(JOBS / "demo.yaml"), "--submit", "--profile-out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "is a directory" in result.output
    # --wait waits for the job on any target; it takes a positive number of seconds.
    result = runner.invoke(app, ["calibrate", str(JOBS / "demo.yaml"), "--submit", "--wait", "-5"])
    assert result.exit_code == 2 and "--wait -5: give a positive" in result.output
    result = runner.invoke(
        app,
        [
            "calibrate",
            str(JOBS / "demo.yaml"),
            "--submit",
            "--wait",
            "0",
            "--set",
            "cluster.target=kubernetes",
        ],
    )
    assert result.exit_code == 2 and "--wait 0: give a positive" in result.output
    assert not (tmp_path / "home" / "jobs").exists()  # nothing was started


@pytest.mark.timeout(120)
def test_the_job_body_refuses_a_gpu_spec_without_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU spec's calibration job on a node without CUDA fails clearly (exit 2) rather than
    profile this CPU as a GPU."""
    import subprocess
    import sys

    monkeypatch.delenv("CTXLAUNCH_CALIBRATE_DRY_RUN", raising=False)
    spec = load_spec(JOBS / "demo.yaml", ["cluster.gpu=H200"])
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json())
    out = tmp_path / "p.json"
    done = subprocess.run(
        [sys.executable, "-m", "ctxlaunch.runtime.calibration.job", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 2
    assert "cluster.gpu 'H200'" in done.stderr and "no CUDA device" in done.stderr
    assert not out.exists()


def test_the_named_profile_wins_over_this_machines_calibration(tmp_path: Path) -> None:
    """report passes the saved CPU calibration; a spec that names its profile is timed with
    the profile (hand-written constants: this checks the routing, not a measurement)."""
    from ctxlaunch.perf.machine import Calibration, save_profile

    spec = load_spec(JOBS / "demo.yaml")
    mine = Calibration(
        matmul_flops_per_second=1e10,
        attention_flops_per_second=1e10,
        memory_bytes_per_second=1e10,
        link_bytes_per_second=1e9,
        link_latency_seconds=1e-5,
        cores=2,
    )
    team = Calibration(**{**mine.__dict__, "matmul_flops_per_second": 3e10})
    path = save_profile(team, spec, tmp_path / "team.json")
    named = load_spec(JOBS / "demo.yaml", [f"cluster.profile={path}"])
    assert machine_for(named, calibration=mine).peak_flops["fp32"] == pytest.approx(3e10 / 2)
    assert machine_for(spec, calibration=mine).peak_flops["fp32"] == pytest.approx(1e10 / 2)


def test_a_pod_spec_leaves_the_submitters_profile_out(tmp_path: Path) -> None:
    """The profile path is on the submitter's machine: the ConfigMap's spec.json omits it, so
    the pod's spec validates; Slurm's script (a shared filesystem) keeps it."""
    from ctxlaunch.launch.request import kubernetes_request, slurm_request

    profile = _profile(tmp_path)
    spec = load_spec(
        JOBS / "demo.yaml",
        [
            f"cluster.profile={profile}",
            "cluster.target=kubernetes",
            "cluster.kubernetes.image=example/ctxlaunch:1",
        ],
    )
    assert json.loads(kubernetes_request(spec).spec_json)["cluster"]["profile"] is None
    assert json.loads(slurm_request(spec).spec_json)["cluster"]["profile"] == str(profile)
