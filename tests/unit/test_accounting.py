"""The whole run before it starts: time to train, GPU-hours, energy and cost from the predicted
step, against the arithmetic done by hand, and how `plan`, `advise` and `sweep` show them."""

from __future__ import annotations

import json
import math

import pytest

from ctxlaunch.cli import app
from ctxlaunch.contract.hardware import GPUS, POWER_SOURCES, REFERENCE_NODE_GPUS
from ctxlaunch.contract.loader import load_spec
from ctxlaunch.perf.accounting import BUSY_TERMS, IDLE_POWER_FRACTION, account, duration
from ctxlaunch.perf.machine import machine_for
from ctxlaunch.perf.steptime import predict_spec
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS

runner = CliRunner()
EXAMPLE = str(JOBS / "llama3-8b-128k-slurm.yaml")


def test_every_gpu_has_its_power_and_its_source() -> None:
    for name, gpu in GPUS.items():
        assert name in POWER_SOURCES, name
        if name != "cpu":
            assert gpu.board_power_watts > 0 and gpu.node_other_power_watts > 0, name


def test_the_run_is_the_steps_at_the_predicted_step_with_its_range() -> None:
    """Each figure against the same arithmetic by hand, from the predicted step's own terms."""
    spec = load_spec(EXAMPLE, ["cluster.gpu_hour_price=2.5"])
    step = predict_spec(spec, machine_for(spec, saved=False))
    run = account(spec, step)
    error = step.expected_error
    assert error > 0  # the ctxlaunch profile's measured error
    seconds = spec.training.steps * step.step_seconds
    assert run.seconds.value == pytest.approx(seconds)
    assert (run.seconds.low, run.seconds.high) == pytest.approx(
        (seconds * (1 - error), seconds * (1 + error))
    )
    assert run.gpu_hours.value == pytest.approx(seconds * 32 / 3600)
    busy = sum(step.terms[t] for t in BUSY_TERMS) / step.step_seconds
    h100 = GPUS["H100"]
    gpu_watts = h100.board_power_watts * (IDLE_POWER_FRACTION + (1 - IDLE_POWER_FRACTION) * busy)
    other = h100.node_other_power_watts * 32 / REFERENCE_NODE_GPUS
    assert run.gpu_watts == pytest.approx(gpu_watts)
    assert run.energy_kwh is not None and run.energy_kwh.value == pytest.approx(
        (32 * gpu_watts + other) * seconds / 3.6e6
    )
    assert run.cost is not None and run.cost.value == pytest.approx(2.5 * seconds * 32 / 3600)
    assert run.cost.high == pytest.approx(2.5 * seconds * (1 + error) * 32 / 3600)
    assert run.tokens == spec.training.steps * spec.tokens_per_step


def test_a_token_budget_sets_the_steps_and_a_price_per_gpu_type_is_read() -> None:
    spec = load_spec(
        EXAMPLE,
        [
            "training.tokens=1000000000",
            'cluster.gpu_hour_price={"H100": 2.0, "H200": 3.0}',
        ],
    )
    assert spec.training.steps == math.ceil(1e9 / spec.tokens_per_step)
    assert spec.cluster.price_per_gpu_hour == 2.0
    # The file's own steps are overridden by the budget, and the warning says so.
    assert any("training.tokens 1,000,000,000 is 477 steps" in w for w in spec.warnings())
    # The resolved spec the job carries reads back the same, with no warning.
    from ctxlaunch.contract.loader import validate_spec

    again = validate_spec(spec.model_dump(mode="json"), "resolved")
    assert again.training.steps == spec.training.steps
    assert not any("training.tokens" in w for w in again.warnings())
    # A GPU without a price: no cost, not an error.
    h200 = load_spec(EXAMPLE, ['cluster.gpu_hour_price={"H200": 3.0}'])
    assert account(h200, predict_spec(h200)).cost is None


def test_an_uncalibrated_machine_gives_no_range_and_a_cpu_no_energy() -> None:
    spec = load_spec(JOBS / "demo.yaml")
    step = predict_spec(spec, machine_for(spec, saved=False))
    run = account(spec, step)
    assert not run.calibrated and not run.seconds.known
    assert run.energy_kwh is None and "no energy" in run.power_source
    assert "uncalibrated" in run.summary()


def test_durations_read_as_two_units() -> None:
    assert [duration(s) for s in (4.2, 42, 250, 3 * 3600 + 720, 2 * 86400 + 5 * 3600)] == [
        "4.2 s",
        "42 s",
        "4 min 10 s",
        "3 h 12 min",
        "2 d 5 h",
    ]


def test_plan_prints_the_run_and_its_json_carries_it() -> None:
    result = runner.invoke(app, ["plan", EXAMPLE, "--set", "cluster.gpu_hour_price=2.5"])
    assert result.exit_code == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("the run: "))
    assert "2,000 steps" in line and "GPU-hours" in line and "kWh" in line and "cost" in line
    assert "per GPU" in result.stdout  # the power line
    data = json.loads(runner.invoke(app, ["plan", EXAMPLE, "--json"]).stdout)
    accounting = data["accounting"]
    assert accounting["steps"] == 2000 and accounting["cost"] is None
    assert accounting["seconds"]["value"] == pytest.approx(2000 * data["step_time"]["step_seconds"])
    result = runner.invoke(app, ["plan", EXAMPLE])
    assert "cost: set cluster.gpu_hour_price to see it" in result.stdout


def test_advise_ranks_by_time_or_cost_across_gpu_counts() -> None:
    from ctxlaunch import api

    result = runner.invoke(app, ["advise", EXAMPLE, "--rank-by", "cost"])
    assert result.exit_code == 2
    assert "--rank-by cost: cluster.gpu_hour_price gives no price for H100" in result.stderr
    assert runner.invoke(app, ["advise", EXAMPLE, "--rank-by", "speed"]).exit_code == 2
    # One search over both counts, ranked one way and then the other.
    advice = api.advise(EXAMPLE, ["cluster.gpu_hour_price=2.5"], gpus=[16, 32], rank_by="time")
    by_time = advice.to_dict(top=None)
    advice.rerank("cost")
    by_cost = advice.to_dict(top=None)
    assert by_time["gpu_counts"] == [16, 32] and by_cost["rank_by"] == "cost"
    times = [r["accounting"]["seconds"]["value"] for r in by_time["ranked"]]
    costs = [r["accounting"]["cost"]["value"] for r in by_cost["ranked"]]
    assert times == sorted(times, key=lambda v: float(f"{v:.4g}"))
    assert costs == sorted(costs, key=lambda v: float(f"{v:.4g}"))
    assert {r["gpus"] for r in by_time["ranked"]} == {16, 32}
    # More GPUs train sooner, and fewer cost less here: the two rankings disagree.
    assert by_time["ranked"][0]["gpus"] == 32 and by_cost["ranked"][0]["gpus"] == 16
    # The command prints the same ranking, with the run's columns.
    shown = runner.invoke(
        app,
        ["advise", EXAMPLE, "--top", "2", "--set", "cluster.gpu_hour_price=2.5"],
    ).stdout
    assert "time to train" in shown and "cost" in shown and "the best, the whole run:" in shown
