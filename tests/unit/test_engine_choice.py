"""training.engine: what shards the model states is an explicit choice, resolved by one rule
(`JobSpec.state_engine`) that the trainer and the planner both read."""

from __future__ import annotations

import pytest

from ctxlaunch.contract.loader import validate_spec
from ctxlaunch.perf.layout import Layout
from tests.helpers.specs import make, problems


@pytest.mark.parametrize(
    "engine, zero, tp, want",
    [
        ("auto", 0, 1, "torch"),
        ("auto", 2, 1, "deepspeed"),
        ("auto", 1, 2, "fsdp2"),
        ("fsdp2", 2, 1, "fsdp2"),
        ("fsdp2", 0, 2, "torch"),
        ("deepspeed", 3, 1, "deepspeed"),
    ],
)
def test_state_engine_resolves_the_field(engine: str, zero: int, tp: int, want: str) -> None:
    spec = validate_spec(
        make(
            **{
                "training.engine": engine,
                "training.zero_stage": zero,
                "parallel.tp": tp,
                "parallel.cp": 4,
            }
        )
    )
    assert spec.state_engine == want
    assert Layout.from_spec(spec).fsdp == (want == "fsdp2")


def test_deepspeed_with_tp_or_pp_is_refused_with_a_fix() -> None:
    found = problems(
        make(
            **{
                "training.engine": "deepspeed",
                "training.zero_stage": 2,
                "parallel.tp": 2,
                "parallel.cp": 4,
            }
        )
    )
    assert "engine: fsdp2" in found["training.engine"]
    assert "tp = 2" in found["training.engine"]


def test_deepspeed_needs_a_zero_stage() -> None:
    found = problems(make(**{"training.engine": "deepspeed"}))
    assert "zero_stage >= 1" in found["training.engine"]
