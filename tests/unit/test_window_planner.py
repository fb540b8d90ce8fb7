"""The planner's terms for local (sliding-window) layers: attention FLOPs of a local layer are
its window's in both MFU conventions; the halo exchange's bytes against the full ring's, and
against what the CP layer's own plan sends; the halo buffers in memory; the soft-capped loss's
logits; and the step time and `advise` reading them."""

from __future__ import annotations

import pytest

from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.cp.documents import RingShards
from ctxlaunch.cp.window import halo_plan_bytes
from ctxlaunch.perf import commvolume
from ctxlaunch.perf.activations import halo_bytes, loss_workspace_bytes
from ctxlaunch.perf.flops import attention_flops_per_token, window_attention_fraction
from ctxlaunch.perf.layout import Layout

GEMMA3_12B = ModelSpec.model_validate({"preset": "gemma-3-12b"})
GLOBAL_ONLY = GEMMA3_12B.model_copy(update={"sliding_window": None})


def test_a_local_layers_attention_flops_are_its_windows() -> None:
    """Per token, a full layer counts s keys (full convention) or s/2 (causal); a local one its
    window, or its band's area per token; a window the sequence fits in is a full layer."""
    s, w = 131072, 1024
    heads, d = GEMMA3_12B.heads, GEMMA3_12B.head_dim
    local, full = GEMMA3_12B.local_layers, GEMMA3_12B.layers - GEMMA3_12B.local_layers
    assert (local, full) == (40, 8)
    assert attention_flops_per_token(GEMMA3_12B, s, "full") == 12 * heads * d * (8 * s + 40 * w)
    band = (s * w - w * (w - 1) / 2) / s
    assert attention_flops_per_token(GEMMA3_12B, s, "causal") == pytest.approx(
        12 * heads * d * (8 * s / 2 + 40 * band)
    )
    assert attention_flops_per_token(GEMMA3_12B, 1024, "full") == attention_flops_per_token(
        GLOBAL_ONLY, 1024, "full"
    )
    assert window_attention_fraction(GLOBAL_ONLY, s) == 1.0
    assert window_attention_fraction(GEMMA3_12B, s) == pytest.approx((8 + 40 * band / (s / 2)) / 48)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp, window", [(4, 9), (8, 1024), (4, 40)])
def test_halo_rows_are_what_the_busiest_rank_receives(sharding, cp, window) -> None:
    """The planner's halo rows per sequence are those the CP layer's own plan has its busiest
    rank receive where the window fits in the chunk before, and a bound on them where it
    spans several (it counts window - 1 rows per chunk, some of which a rank holds itself)."""
    seq_len = 128 if window < 100 else 131072
    layout = Layout(seq_len=seq_len, dims=ParallelDims(cp=cp, cp_sharding=sharding))
    received = halo_plan_bytes(None, seq_len, RingShards(sharding, cp), window, row_bytes=1)
    chunk = seq_len // (cp if sharding == "contiguous" else 2 * cp)
    planned = 2 * commvolume.halo_rows(layout, window)
    assert max(received) == planned if window - 1 <= chunk else max(received) <= planned


def test_halo_traffic_against_the_full_ring() -> None:
    """Gemma 3 12B at 128K over CP 8: a local layer moves the 1,023 rows before each of a rank's
    two chunks where the full ring moves seven shards of 16,384; the step's CP bytes are the
    full layers' ring and the local layers' halos."""
    layout = Layout(seq_len=131072, dims=ParallelDims(cp=8, cp_sharding="zigzag"))
    ring = commvolume.cp_block_bytes(GEMMA3_12B, layout)
    halo = commvolume.halo_block_bytes(GEMMA3_12B, layout, 1024)
    # Per local layer: 2 chunks x 1,023 rows, against 7 hops of 16,384 rows.
    assert commvolume.halo_rows(layout, 1024) == 2 * 1023
    assert halo < ring / 50
    per_layer = commvolume.layer_cp_bytes(GEMMA3_12B, layout)
    assert per_layer.count(ring) == 8 and per_layer.count(halo) == 40
    with_windows = commvolume.step_comm_bytes(GEMMA3_12B, layout).cp
    without = commvolume.step_comm_bytes(GLOBAL_ONLY, layout).cp
    assert with_windows == pytest.approx(without * (8 * ring + 40 * halo) / (48 * ring))


def test_halo_buffers_and_capped_logits_in_memory() -> None:
    """Each local block keeps its halo (K/V of its rows, compute dtype) for backward, none under
    full checkpointing; a soft-capped loss keeps one more fp32 logits chunk."""
    layout = Layout(seq_len=131072, dims=ParallelDims(cp=8))
    rows = 40 / 48 * 2 * 1023
    assert halo_bytes(GEMMA3_12B, layout) == pytest.approx(rows * 2 * GEMMA3_12B.kv_hidden * 2)
    assert halo_bytes(GEMMA3_12B, layout.replace(activation_checkpointing="full")) == 0
    assert halo_bytes(GLOBAL_ONLY, layout) == 0
    capped = GEMMA3_12B.model_copy(update={"logit_softcap": 30.0})
    extra = loss_workspace_bytes(capped, layout) - loss_workspace_bytes(GEMMA3_12B, layout)
    assert extra == 4 * GEMMA3_12B.vocab * 2048


def test_advise_and_the_step_time_read_the_windows() -> None:
    """The windowed model's predicted step is faster than the same model with full attention
    everywhere at 128K on CP 8 (its attention shrinks to the full layers' and the bands'):
    what `advise` ranks layouts by (test_advise runs it on the recipe, as on every example)."""
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.steptime import predict
    from tests.helpers.paths import JOBS

    spec = load_spec(JOBS / "gemma3-12b-extend-128k.yaml")
    machine = machine_for(spec)
    layout = Layout.from_spec(spec)
    windowed = predict(spec.model, layout, machine)
    full = predict(spec.model.model_copy(update={"sliding_window": None}), layout, machine)
    assert windowed.terms["compute_attention"] < full.terms["compute_attention"] / 3
    # The full ring hides its hops behind attention; a local layer's halo exchange flies
    # beside its own block only, so a little of it shows, a small share of the step.
    assert windowed.terms["cp_ring_exposed"] < 0.01 * windowed.step_seconds
    assert windowed.step_seconds < full.step_seconds
