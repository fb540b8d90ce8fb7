"""The CPU calibration end to end: measure (small sizes, real torch and real gloo over
127.0.0.1), save, and `advise` / the step-time model on a CPU spec use the measured constants.
No timing is asserted: this machine is shared and busy; benchmarks/steptime_cpu.py checks the
predictions against measured step times and BENCHMARKS.md records them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import load_spec
from ctxlaunch.perf.machine import Calibration, load_calibration, machine_for, save_calibration
from ctxlaunch.perf.steptime import predict_spec
from ctxlaunch.planning.advise import advise
from ctxlaunch.runtime.calibration.cpu import measure
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS


@pytest.mark.timeout(180)
def test_measured_constants_drive_the_cpu_prediction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path))
    calibration = measure(
        seq=256,
        repeats=2,
        sizes=(4096, 262144, 2**21),
        sync_ranks=(2,),
        sync_readings=1,
        rate_readings=2,
    )
    for value in (
        calibration.matmul_flops_per_second,
        calibration.attention_flops_per_second,
        calibration.memory_bytes_per_second,
        calibration.link_bytes_per_second,
        calibration.link_latency_seconds,
        calibration.elementwise_bytes_per_second,
    ):
        assert value > 0
    save_calibration(calibration)
    assert load_calibration() == calibration

    spec = load_spec(JOBS / "demo.yaml")
    machine = machine_for(spec, calibration=calibration)
    assert calibration.one_thread is not None
    assert all(calibration.one_thread[k] > 0 for k in ("matmul", "attention", "elementwise"))
    # Two ranks on this machine's cores: each runs one thread, at the one-thread rates scaled by
    # cores / ranks; one rank gets the all-core rates.
    scale = calibration.cores / 2 if calibration.cores <= 2 else None
    if scale is not None:
        assert machine.peak_flops["fp32"] == pytest.approx(calibration.one_thread["matmul"] * scale)
        assert machine.elementwise_bytes_per_second == pytest.approx(
            calibration.one_thread["elementwise"] * scale
        )
    else:
        assert machine.peak_flops["fp32"] == pytest.approx(calibration.matmul_flops_per_second / 2)
    assert calibration.machine(1).peak_flops["fp32"] == pytest.approx(
        calibration.matmul_flops_per_second
    )
    assert machine.intra_node.bytes_per_second == calibration.link_bytes_per_second
    calibrated = predict_spec(spec, machine)
    doubled = predict_spec(
        spec,
        Calibration(
            **{
                **calibration.__dict__,
                "attention_flops_per_second": 2 * calibration.attention_flops_per_second,
                "one_thread": {
                    **calibration.one_thread,
                    "attention": 2 * calibration.one_thread["attention"],
                },
            }
        ).machine(2),
    )
    assert doubled.terms["compute_attention"] == pytest.approx(
        calibrated.terms["compute_attention"] / 2
    )

    result = CliRunner().invoke(app, ["advise", str(JOBS / "demo.yaml"), "--json"])
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["ranked"][0]
    # `advise` used the saved constants: its ranking is the calibrated model's, not the
    # placeholder table's.
    assert best["step_seconds"] == pytest.approx(
        advise(spec, machine=calibration.machine(2)).best.time.step_seconds
    )
    assert best["step_seconds"] != pytest.approx(advise(spec).best.time.step_seconds)


def test_the_attention_rate_can_be_measured_on_its_own_block_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The real kernel, watched: every attention call runs on the attention block's length, the
    # projections' matmuls on `seq`.
    from ctxlaunch.cp import kernels
    from ctxlaunch.runtime.calibration.cpu import measure_compute

    lengths: list[int] = []
    real = kernels.attention_forward

    def watched(q, k, v, causal, scale):  # type: ignore[no-untyped-def]
        lengths.append(q.shape[2])
        return real(q, k, v, causal, scale)

    monkeypatch.setattr(kernels, "attention_forward", watched)
    matmul, attention, tile, _ = measure_compute(
        seq=128, attention_seq=384, repeats=1, projections=((64, 64),), threads=1
    )
    assert lengths and set(lengths) == {384}
    assert matmul > 0 and attention > 0 and tile >= 0


def test_the_attention_ramp_is_fitted_on_two_lengths_and_slows_short_calls() -> None:
    """rate(L) = R x L / (L + L0) through two measured rates gives back R and L0; a rate that
    falls with the length (noise) gives no ramp; with a ramp, a layout whose calls are shorter
    (a zigzag ring of 4: half-blocks of s / 8) pays more attention time per FLOP."""
    from ctxlaunch.runtime.calibration.fitting import fit_ramp

    def rate(length: int) -> float:
        return 2e11 * length / (length + 1000.0)

    peak, ramp = fit_ramp(1536, rate(1536), 6144, rate(6144))
    assert peak == pytest.approx(2e11) and ramp == pytest.approx(1000.0)
    assert fit_ramp(1536, 2e11, 6144, 1.9e11) == (1.9e11, 0.0)

    base = Calibration(
        matmul_flops_per_second=1e11,
        attention_flops_per_second=2e11,
        memory_bytes_per_second=5e10,
        link_bytes_per_second=3e9,
        link_latency_seconds=1e-4,
        cores=2,
    )
    spec = load_spec(JOBS / "demo.yaml", ["parallel.cp=1", "cluster.gpus_per_node=1"])
    ring = load_spec(JOBS / "demo.yaml", ["parallel.cp=4", "cluster.gpus_per_node=4"])
    for s, s_calls in ((spec, 8192), (ring, 8192 / 8)):
        flat = predict_spec(s, base.machine(s.cluster.gpus_per_node)).terms["compute_attention"]
        ramped = predict_spec(
            s,
            Calibration(**{**base.__dict__, "attention_ramp_tokens": 1000.0}).machine(
                s.cluster.gpus_per_node
            ),
        ).terms["compute_attention"]
        assert ramped == pytest.approx(flat * (1 + 1000.0 / s_calls))


def test_the_exchange_cost_grows_as_the_root_of_the_compute_between_exchanges() -> None:
    """cost(tau) = s0 + c x sqrt(tau) through two readings gives back c, and a longer compute
    whose exchange read cheaper (noise) gives no growth; s0 is the measured cost stated at no
    compute. The model charges each blocking synchronisation at its layout's own interval, the
    micro-batch's compute over its synchronisations."""
    from ctxlaunch.runtime.calibration.fitting import fit_sync_jitter

    def cost(tau: float) -> float:
        return 4e-4 + 0.03 * tau**0.5

    s0, growth = fit_sync_jitter((cost(1e-4), 1e-4), (cost(6.5e-3), 6.5e-3))
    assert s0 == pytest.approx(4e-4) and growth == pytest.approx(0.03)
    assert fit_sync_jitter((5e-4, 1e-4), (4e-4, 6.5e-3)) == (5e-4, 0.0)

    flat = Calibration(
        matmul_flops_per_second=1e11,
        attention_flops_per_second=2e11,
        memory_bytes_per_second=5e10,
        link_bytes_per_second=3e9,
        link_latency_seconds=1e-4,
        cores=2,
        sync_seconds={"2": s0},
    )
    grows = Calibration(**{**flat.__dict__, "sync_jitter": {"2": growth}})
    assert grows.machine(2).sync_seconds == pytest.approx(4e-4)
    assert grows.machine(2).sync_jitter == growth and grows.machine(1).sync_jitter == 0.0
    ring = load_spec(JOBS / "demo.yaml", ["parallel.cp=2", "cluster.gpus_per_node=2"])
    before = predict_spec(ring, flat.machine(2))
    after = predict_spec(ring, grows.machine(2))
    # demo: 2 layers, a zigzag ring of 2: one hop forward and one backward a layer, then the
    # step's gradient all-reduce
    syncs = 2 * 2
    tau = after.detail["microbatch_seconds"] / syncs
    assert after.terms["sync_overhead"] == pytest.approx((syncs + 1) * (4e-4 + 0.03 * tau**0.5))
    assert before.terms["sync_overhead"] == pytest.approx((syncs + 1) * 4e-4)
