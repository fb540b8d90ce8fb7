"""A predicted step tells where its constants come from: measured on this machine (with the
error measured for a CPU calibration on its own machine), measured on another one
(uncalibrated here: no error is claimed, and the way to calibrate is given), not measured at all
(the CPU table's placeholders), or a framework profile measured on one GPU type and scaled to
another."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import load_spec
from ctxlaunch.perf.machine import Calibration, host_signature, machine_for, save_calibration
from ctxlaunch.perf.profiles import fitted_values
from ctxlaunch.perf.steptime import predict_spec
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS

CALIBRATION = Calibration(
    matmul_flops_per_second=50e9,
    attention_flops_per_second=20e9,
    memory_bytes_per_second=10e9,
    link_bytes_per_second=1e9,
    link_latency_seconds=50e-6,
    cores=2,
    measured_at="the test",
)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_without_a_calibration_the_cpu_step_is_uncalibrated_and_claims_no_error() -> None:
    spec = load_spec(JOBS / "demo.yaml")
    step = predict_spec(spec, machine_for(spec))
    assert step.provenance.state == "not-measured" and not step.provenance.calibrated
    assert step.expected_error == 0.0
    assert "ctxlaunch calibrate" in step.provenance.calibrate


def test_a_calibration_of_this_machine_carries_its_own_measured_error() -> None:
    spec = load_spec(JOBS / "demo.yaml")
    save_calibration(dataclasses.replace(CALIBRATION, host=host_signature()))
    step = predict_spec(spec, machine_for(spec))
    assert step.provenance.state == "measured-here" and step.provenance.calibrated
    assert step.expected_error == fitted_values("ctxlaunch-cpu")["expected_error"] > 0


@pytest.mark.parametrize("host", [None, {"cpu": "another processor", "cores": 96}])
def test_another_machines_calibration_is_named_and_not_trusted(host: dict | None) -> None:
    spec = load_spec(JOBS / "demo.yaml")
    save_calibration(dataclasses.replace(CALIBRATION, host=host))
    step = predict_spec(spec, machine_for(spec))
    assert step.provenance.state == "measured-elsewhere" and not step.provenance.calibrated
    assert step.expected_error == 0.0
    assert "not on this machine" in step.provenance.note


def test_the_gpu_profile_says_which_gpu_it_was_measured_on() -> None:
    h200 = load_spec(JOBS / "llama3-8b-128k-slurm.yaml", ["cluster.gpu=H200"])
    h100 = load_spec(JOBS / "llama3-8b-128k-slurm.yaml", ["cluster.gpu=H100"])
    on_h200 = predict_spec(h200, machine_for(h200)).provenance
    on_h100 = predict_spec(h100, machine_for(h100)).provenance
    assert on_h200.note == "the ctxlaunch profile, measured on an H200" and not on_h200.calibrate
    assert "scaled to H100" in on_h100.note and "calibrate SPEC --submit" in on_h100.calibrate


def test_plan_prints_the_provenance() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["plan", str(JOBS / "demo.yaml")])
    assert result.exit_code == 0, result.output
    assert "step time uncalibrated here: no CPU calibration" in result.output
    as_json = runner.invoke(app, ["plan", str(JOBS / "demo.yaml"), "--json"])
    calibration = json.loads(as_json.stdout)["step_time"]["calibration"]
    assert calibration["state"] == "not-measured" and calibration["calibrated"] is False


def test_submit_says_the_step_is_uncalibrated_here_before_anything_runs() -> None:
    result = CliRunner().invoke(app, ["submit", str(JOBS / "demo.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "predicted step" in result.output and "step time uncalibrated here" in result.output
    assert "ctxlaunch calibrate" in result.output
