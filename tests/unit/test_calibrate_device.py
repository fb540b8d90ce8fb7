"""The GPU calibration (ctxlaunch.runtime.calibration.gpu): its solvers recover the constants
that generated their inputs, its profile becomes the machine `plan` times with, and the whole
calibration job runs end to end through the local backend. No GPU is here: the job runs its
GPU code path on this CPU (CTXLAUNCH_CALIBRATE_DRY_RUN=1: gloo instead of NCCL, the real
trainer on `gpu: cpu`), which checks every step of it but measures nothing a GPU would; the
profile says it is a dry run. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ctxlaunch.cli import app
from ctxlaunch.contract.hardware import GPUS
from ctxlaunch.contract.loader import load_spec
from ctxlaunch.perf import profiles
from ctxlaunch.perf.machine import GpuCalibration, load_profile, machine_for, save_profile
from ctxlaunch.perf.steptime import predict_spec
from ctxlaunch.runtime.calibration.fitting import fit_line, fit_residual
from ctxlaunch.runtime.calibration.gpu import COLLECTIVES
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS

runner = CliRunner()
H200 = GPUS["H200"]


@pytest.mark.parametrize("fraction, ramp", [(0.318, 1231.0), (0.45, 300.0), (0.2, 5000.0)])
def test_solve_attention_recovers_the_rate_and_ramp(fraction: float, ramp: float) -> None:
    calls = []
    for tokens in (12288, 24576):
        entries = 32 * tokens * tokens / 2
        seconds = profiles.attention_seconds(
            entries,
            128,
            tokens,
            peak=H200.peak_bf16_flops,
            fraction=fraction,
            ramp_tokens=ramp,
            sfu_ops_per_second=H200.sfu_ops_per_second,
            exp_exposed=True,
            matmul_flops_per_entry=12,
        )
        calls.append((tokens, seconds, 32, 128))
    got_fraction, got_ramp = profiles.solve_attention(
        calls, peak=H200.peak_bf16_flops, sfu_ops_per_second=H200.sfu_ops_per_second
    )
    assert got_fraction == pytest.approx(fraction, rel=1e-6)
    assert got_ramp == pytest.approx(ramp, rel=1e-4)


def test_solve_attention_gives_no_ramp_where_the_rate_does_not_grow() -> None:
    # The longer call slower per FLOP than the shorter: noise, no ramp, the longer call's rate.
    calls = [(4096, 0.010, 32, 128), (8192, 0.050, 32, 128)]
    fraction, ramp = profiles.solve_attention(calls, peak=1e15, sfu_ops_per_second=0.0)
    assert ramp == 0.0
    assert fraction == pytest.approx(12 * 128 * 32 * 8192**2 / 2 / 0.050 / 1e15)


def test_fit_residual_tells_the_blocks_rate_from_the_loss_rate() -> None:
    """Three trainer runs (two lengths, and the longer again at a shallower depth) determine the
    blocks' elementwise rate, the loss's rate and the fixed cost that generated them."""
    fraction, loss_fraction, fixed = 0.21, 0.58, 0.032
    points = []
    # (elementwise, loss, other) terms at the bandwidth: 4 blocks at 6K and 12K, 1 at 12K.
    for elementwise, loss, other in (
        (0.0016, 0.0085, 0.030),
        (0.0032, 0.0170, 0.062),
        (0.0008, 0.0170, 0.020),
    ):
        terms = {"compute_matmul": other, "compute_elementwise": elementwise, "compute_loss": loss}
        points.append((other + elementwise / fraction + loss / loss_fraction + fixed, terms))
    got = fit_residual(points)
    assert got == (pytest.approx(fraction), pytest.approx(loss_fraction), pytest.approx(fixed))
    # One rate (the loss's as the blocks') cannot fit the shallow run: the fit is not that.
    assert abs(got[0] - got[1]) > 0.3


def test_fit_residual_holds_rates_at_the_bandwidth_and_the_fixed_cost_at_zero() -> None:
    # Faster than the bandwidth (noise) is held at the bandwidth, the rest fixed, never < 0.
    faster = [
        (0.31, {"compute_elementwise": 0.010, "compute_loss": 0.002, "x": 0.30}),
        (0.97, {"compute_elementwise": 0.025, "compute_loss": 0.004, "x": 0.95}),
        (0.90, {"compute_elementwise": 0.005, "compute_loss": 0.004, "x": 0.89}),
    ]
    fraction, loss_fraction, fixed = fit_residual(faster)
    assert (fraction, loss_fraction) == (1.0, 1.0) and fixed >= 0.0
    slower = [(m + 0.5, t) for m, t in faster]  # a pure fixed cost on top
    assert fit_residual(slower)[2] == pytest.approx(0.5, abs=0.02)


def test_fit_line_recovers_bandwidth_and_latency() -> None:
    sizes = [1e6, 16e6, 128e6]
    bandwidth, latency = fit_line(sizes, [20e-6 + s / 300e9 for s in sizes])
    assert bandwidth == pytest.approx(300e9)
    assert latency == pytest.approx(20e-6)


def _profile(**changes: object) -> GpuCalibration:
    collectives = {
        op: {"bus_bytes_per_second": bus, "latency_seconds": lat}
        for op, bus, lat in zip(
            COLLECTIVES,
            (360e9, 340e9, 350e9, 200e9, 380e9),
            (20e-6, 12e-6, 14e-6, 30e-6, 8e-6),
            strict=True,
        )
    }
    base = GpuCalibration(
        gpu="H200",
        device_name="NVIDIA H200",
        network="infiniband-ndr",
        gpus_per_node=8,
        precision="bf16",
        eta_matmul=0.62,
        attention_fraction=0.30,
        attention_ramp_tokens=900.0,
        attention_kernel="flash",
        collectives=collectives,
        elementwise_fraction_of_hbm=0.09,
        microbatch_overhead_seconds=0.004,
        expected_error=0.06,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_a_gpu_profile_is_the_machine_plan_times_with(tmp_path: Path) -> None:
    calibration = _profile()
    machine = calibration.machine(gpus_per_node=8)
    assert machine.eta_matmul["bf16"] == 0.62
    assert (machine.eta_attention, machine.attention_ramp_tokens) == (0.30, 900.0)
    assert machine.elementwise_bytes_per_second == pytest.approx(0.09 * H200.hbm_bytes_per_second)
    assert machine.microbatch_overhead_seconds == 0.004
    assert machine.expected_error == 0.06
    # The intra-node link: the collectives' median bus bandwidth and latency, as measured.
    assert machine.bandwidth(machine.intra_node) == pytest.approx(350e9)
    assert machine.intra_node.latency_seconds == 14e-6
    # The fabric between nodes was not measured: the table's.
    assert (
        machine.network
        == machine_for(load_spec(JOBS / "demo.yaml", ["cluster.gpu=H200"]), saved=False).network
    )

    spec = load_spec(JOBS / "demo.yaml", ["cluster.gpu=H200", "model.dtype=bf16"])
    path = save_profile(calibration, spec, tmp_path / "h200.json")
    assert json.loads(path.read_text())["kind"] == "gpu"
    assert load_profile(path) == calibration
    named = load_spec(
        JOBS / "demo.yaml", ["cluster.gpu=H200", "model.dtype=bf16", f"cluster.profile={path}"]
    )
    timed = predict_spec(named, machine_for(named))
    assert timed.step_seconds == pytest.approx(
        predict_spec(named, calibration.machine(2)).step_seconds
    )
    assert timed.expected_error == 0.06
    # The measured constants move the prediction away from the tables'.
    assert timed.step_seconds != pytest.approx(predict_spec(spec).step_seconds, rel=1e-3)


@pytest.mark.timeout(900)
def test_the_gpu_calibration_job_runs_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`calibrate SPEC --submit` on an H200 spec, its GPU code path run on this CPU: the
    collectives among two processes, the matmuls, the attention kernel the trainer picks, the
    real trainer at three lengths; then plan times the spec with the profile it wrote."""
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CTXLAUNCH_CALIBRATE_DRY_RUN", "1")
    spec = tmp_path / "demo.yaml"
    spec.write_text((JOBS / "demo.yaml").read_text())
    result = runner.invoke(app, ["calibrate", str(spec), "--submit", "--set", "cluster.gpu=H200"])
    assert result.exit_code == 0, result.output
    profile = tmp_path / "profiles" / "H200-infiniband-ndr.json"
    data = json.loads(profile.read_text())
    assert (data["kind"], data["gpu"]) == ("gpu", "H200")
    calibration = load_profile(profile)
    assert isinstance(calibration, GpuCalibration)
    assert calibration.dry_run and calibration.device_name == "cpu (dry run)"
    assert sorted(calibration.collectives) == sorted(COLLECTIVES)
    assert all(c["bus_bytes_per_second"] > 0 for c in calibration.collectives.values())
    assert 0 < calibration.eta_matmul <= 1 and calibration.attention_fraction > 0
    assert 0 < calibration.elementwise_fraction_of_hbm <= 1
    assert calibration.loss_fraction_of_hbm is not None
    assert 0 < calibration.loss_fraction_of_hbm <= 1
    # Two lengths and a held-out third at the cut depth, the longer fit length again at 1 block.
    depth = min(load_spec(spec).model.layers, 4)
    assert sorted(calibration.trainer_step_seconds) == sorted(
        [f"{depth}x256", f"{depth}x512", "1x512", f"{depth}x1024"]
    )
    assert calibration.lengths["trainer_held_out"] == 1024
    assert calibration.expected_error > 0  # the held-out step, predicted and measured

    plan = runner.invoke(
        app,
        [
            "plan",
            str(spec),
            "--set",
            "cluster.gpu=H200",
            "--set",
            f"cluster.profile={profile}",
            "--json",
        ],
    )
    assert plan.exit_code == 0, plan.output
    named = load_spec(spec, ["cluster.gpu=H200", f"cluster.profile={profile}"])
    step = json.loads(plan.stdout)["step_time"]["step_seconds"]
    assert step == pytest.approx(predict_spec(named, calibration.machine(2)).step_seconds)
