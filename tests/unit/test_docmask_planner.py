"""The planner's cost of a document mask: the attended share of the causal area from the
token-weighted document length, checked against the CP schedule's own count, and the step-time
attention term scaled by it (the diagonal-tile waste kept)."""

from __future__ import annotations

import pytest

from ctxlaunch.contract.hardware import GPUS
from ctxlaunch.contract.loader import SpecError, validate_spec
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.cp import attention_area
from ctxlaunch.perf.flops import document_attention_fraction, token_weighted_document_tokens
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine
from ctxlaunch.perf.steptime import predict

LLAMA_8B = ModelSpec(preset="llama3-8b")


def test_attended_fraction_is_the_schedules_count() -> None:
    # Documents of 3, 7 and 6 tokens in 16: sum of squares 94, so m = 94 / 16 = 5.875 and the
    # share is (m + 1) / (S + 1) = 6.875 / 17 = 55 / 136, the ring schedule's own count.
    m = token_weighted_document_tokens([3, 7, 6])
    assert m == 94 / 16
    assert document_attention_fraction(16, m) == pytest.approx(55 / 136)
    assert attention_area([(0, 3, 10, 16)], 16, 2).computed_fraction == pytest.approx(55 / 136)
    assert document_attention_fraction(4096, 10**6) == 1.0  # documents longer than a sequence
    with pytest.raises(ValueError, match="must be positive"):
        document_attention_fraction(4096, 0)


def test_step_time_attention_follows_the_attended_fraction() -> None:
    machine = Machine.from_gpu(GPUS["H100"], network="infiniband-ndr", gpus_per_node=8)
    layout = Layout(seq_len=131072, cp=8, dp=1)
    fraction = document_attention_fraction(131072, 8192)
    plain = predict(LLAMA_8B, layout, machine)
    masked = predict(LLAMA_8B, layout.replace(attended_fraction=fraction), machine)
    tile = machine.causal_tile_tokens / 131072
    assert masked.terms["compute_attention"] == pytest.approx(
        plain.terms["compute_attention"] * (fraction + tile) / (1 + tile)
    )
    assert masked.terms["compute_matmul"] == plain.terms["compute_matmul"]
    assert masked.step_seconds < plain.step_seconds


def _spec(data: dict) -> dict:
    return {
        "name": "x",
        "model": {"preset": "tiny"},
        "training": {"seq_len": 4096, "data": data},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }


def test_the_spec_carries_the_document_length_to_the_layout(tmp_path) -> None:
    import numpy as np

    from ctxlaunch.runtime.data.indexed import IndexedWriter

    prefix = tmp_path / "d"
    with IndexedWriter(prefix, np.uint16) as writer:
        writer.add_document([1, 2, 0])
    data = {"source": "tokens", "path": str(prefix), "document_mask": True}
    assert Layout.from_spec(validate_spec(_spec(data))).attended_fraction == 1.0
    spec = validate_spec(_spec(data | {"mean_document_tokens": 1024}))
    assert Layout.from_spec(spec).attended_fraction == pytest.approx(1025 / 4097)
    with pytest.raises(SpecError) as caught:
        validate_spec(
            _spec({"source": "tokens", "path": str(prefix), "mean_document_tokens": 1024})
        )
    assert "training.data.mean_document_tokens" in str(caught.value)
    assert "document_mask: true" in str(caught.value)
