"""The planner's cost of a document mask: the attended share of the causal area from the
token-weighted document length, checked against the CP schedule's own count, and the step-time
attention term scaled by it (the diagonal-tile waste kept)."""

from __future__ import annotations

import pytest

from ctxlaunch.contract.hardware import GPUS
from ctxlaunch.contract.loader import SpecError, validate_spec
from ctxlaunch.contract.parallel_dims import ParallelDims
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
    layout = Layout(seq_len=131072, dims=ParallelDims(cp=8, dp=1))
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


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring_degree", [2, 4, 8, 16])
def test_ring_imbalance_is_the_schedules_count(sharding: str, ring_degree: int) -> None:
    """The planner's pure-Python estimate counts each rank's area as the CP schedule does
    (`attention_area`, which walks the ring's blocks) on the same packed sequences."""
    from ctxlaunch.perf.docbalance import SEQUENCES, _packed, ring_imbalance

    seq_len, document_tokens = 65536, 4096.0
    sequences = _packed(seq_len, document_tokens, SEQUENCES)
    counted = [
        attention_area([tuple(b)], seq_len, ring_degree, sharding).busiest_over_mean
        for b in sequences
    ]
    want = sum(counted) / len(counted)
    assert ring_imbalance(seq_len, ring_degree, sharding, document_tokens) == pytest.approx(want)
    assert want > 1.1  # packed documents of this length leave a fixed sharding unbalanced


def test_ring_imbalance_is_one_where_the_ranks_are_balanced() -> None:
    from ctxlaunch.perf.docbalance import ring_imbalance

    assert ring_imbalance(65536, 8, "balanced", 4096.0) == 1.0
    assert ring_imbalance(65536, 1, "zigzag", 4096.0) == 1.0  # no ring (Ulysses)
    assert ring_imbalance(65536, 8, "zigzag", None) == 1.0  # no known document length
    # Many short documents per chunk: every chunk holds about the same area.
    assert ring_imbalance(1 << 20, 2, "zigzag", 100.0) == 1.0


def test_step_time_costs_the_busiest_ring_rank_under_a_fixed_sharding() -> None:
    """Under a document mask the step follows the ring's busiest rank: zigzag's attention term
    is its imbalance times the balanced sharding's (the diagonal-tile waste aside); Ulysses,
    whose ranks all compute the whole sequence, is unaffected by the sharding."""
    machine = Machine.from_gpu(GPUS["H100"], network="infiniband-ndr", gpus_per_node=8)
    fraction = document_attention_fraction(131072, 8192)
    masked = Layout(
        seq_len=131072,
        attended_fraction=fraction,
        document_tokens=8192,
        dims=ParallelDims(cp=8, dp=1),
    )
    zigzag = masked.with_dims(cp_sharding="zigzag")
    balanced = masked.with_dims(cp_sharding="balanced")
    assert zigzag.attention_imbalance > 1.1 and balanced.attention_imbalance == 1.0
    tile = machine.causal_tile_tokens / 131072
    got = {
        layout.dims.cp_sharding: predict(LLAMA_8B, layout, machine).terms["compute_attention"]
        for layout in (zigzag, balanced)
    }
    assert got["zigzag"] == pytest.approx(
        got["balanced"] * (fraction * zigzag.attention_imbalance + tile) / (fraction + tile)
    )
    ulysses = [
        predict(LLAMA_8B, layout.with_dims(cp_algorithm="ulysses", ulysses_degree=8), machine)
        for layout in (zigzag, balanced)
    ]
    assert ulysses[0].terms["compute_attention"] == ulysses[1].terms["compute_attention"]


def test_the_spec_carries_the_sharding_to_the_step_time(tmp_path) -> None:
    """A masked spec with a document length gives the planner zigzag's imbalance, and none
    under the balanced sharding."""
    import numpy as np

    from ctxlaunch.runtime.data.indexed import IndexedWriter

    prefix = tmp_path / "d"
    with IndexedWriter(prefix, np.uint16) as writer:
        writer.add_document([1, 2, 0])
    data = {"source": "tokens", "path": str(prefix), "document_mask": True}
    spec = _spec(data | {"mean_document_tokens": 1024})
    spec["training"]["seq_len"] = 65536
    spec["cluster"]["gpus_per_node"] = 4
    layouts = {
        sharding: Layout.from_spec(
            validate_spec(spec | {"parallel": {"cp": 4, "cp_sharding": sharding}})
        )
        for sharding in ("zigzag", "balanced")
    }
    assert layouts["zigzag"].document_tokens == 1024
    assert layouts["zigzag"].attention_imbalance > 1.1
    assert layouts["balanced"].attention_imbalance == 1.0


def test_advise_offers_the_balanced_sharding_where_zigzag_leaves_a_rank_busier() -> None:
    """Under a document mask (the 128K extension example: 32K-token documents) with a spec that
    states zigzag, every ring and hybrid whose zigzag shards leave the busiest rank more
    attention than the mean is also ranked with the balanced sharding, which is faster; the
    advice's spec runs it."""
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.planning.advise import advise, degree_options
    from tests.helpers.paths import JOBS

    spec = load_spec(JOBS / "llama3-8b-extend-128k.yaml", ["parallel.cp_sharding=zigzag"])
    options = degree_options(spec, 32, 8, 8)
    balanced = [o for o in options if o.dims.cp_sharding == "balanced"]
    assert balanced and all(o.dims.ring_degree > 1 for o in balanced)
    for layout in balanced:
        assert layout.with_dims(cp_sharding="zigzag") in options
        assert layout.with_dims(cp_sharding="zigzag").attention_imbalance > 1.0
    assert all(o.dims.cp_sharding == "zigzag" for o in options if o.dims.ring_degree == 1)
    advice = advise(spec)
    ring_candidates = [c for c in advice.ranked if c.layout.dims.ring_degree > 1]
    best = ring_candidates[0]
    assert best.layout.dims.cp_sharding == "balanced" and "balanced" in best.describe()
    assert best.layout.overrides()["parallel.cp_sharding"] == "balanced"
    same_but_zigzag = [
        c for c in advice.ranked if c.layout == best.layout.with_dims(cp_sharding="zigzag")
    ]
    for other in same_but_zigzag:
        assert other.time.step_seconds > best.time.step_seconds
