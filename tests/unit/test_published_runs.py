"""The step-time model against published runs no one here measured.

Every row is a layout its authors ran, with the throughput they published, held as data with its
source. One tolerance for every row (`TOLERANCE`), never tuned per row. Two efficiencies of the
Megatron profile (profiles.MEGATRON_ETA_MATMUL, BF16 and FP8) are fitted on the fit subset
(published.FIT_ROWS, benchmarks/fit_steptime.py); the held-out rows (published.HELD_OUT_ROWS)
are never fitted on and are checked here like the others; everything else is measured
(profiles: the H200 flash-attention timings) or a data-sheet value.

What the sources do not state (activation checkpointing, virtual pipeline stages) is taken as
the fastest setting that the planner says fits (ctxlaunch.perf.published, where the rows
live).
"""

from __future__ import annotations

import itertools

import pytest

from ctxlaunch.contract.hardware import GPUS
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine
from ctxlaunch.perf.memory import estimate
from ctxlaunch.perf.published import ROWS, PublishedRun, best_fitting, candidate_layouts
from ctxlaunch.perf.published import row_machine as machine_for

TOLERANCE = 0.15
"""Predicted throughput within 15 % of the published one, for every row."""
ORDER_MARGIN = 0.10
"""Rows of one table whose published throughputs differ by more than this must be predicted in
the same order (closer ones are within the tables' own run-to-run spread)."""


def predicted_tflops(row: PublishedRun, machine: Machine | None = None) -> float:
    found = best_fitting(row, machine or machine_for(row))
    assert found is not None, f"{row.name}: the planner says no setting of it fits"
    return found[1].model_flops_per_second_per_gpu[row.convention] / 1e12


def relative_error(row: PublishedRun, machine: Machine | None = None) -> float:
    return predicted_tflops(row, machine) / row.tflops_per_gpu - 1


# --------------------------------------------------------------------------------------------
def test_the_rows_add_up() -> None:
    # Tokens per step as published: NeMo 4M (batch x seq), Llama 3 16M.
    for row in ROWS:
        tokens = row.global_batch * row.seq_len
        assert tokens == (4 * 2**20 if row.table.startswith("nemo") else 16 * 2**20), row.name
    assert [r.gpus for r in ROWS if r.table == "llama3"] == [8192, 16384, 16384]
    assert [r.gpus for r in ROWS if r.table == "nemo-h100"] == [
        4,
        8,
        16,
        32,
        64,
        128,
        256,
        512,
        1024,
    ]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_every_published_layout_is_predicted_to_fit(row: PublishedRun) -> None:
    assert best_fitting(row, machine_for(row)) is not None


def _bundled(layout: Layout) -> Layout:
    """The same layout as the bundled trainer would run it (engine auto: DeepSpeed at TP 1 x
    PP 1, FSDP2 otherwise; at least ZeRO-1, as the published runs shard their optimizer)."""
    return layout.replace(framework="ctxlaunch", zero_stage=max(layout.zero_stage, 1))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_every_published_layout_fits_the_bundled_trainer(row: PublishedRun) -> None:
    """At the published TP/CP/PP/DP, some checkpointing setting fits the bundled trainer's own
    memory habits as `plan` sees them (bf16 FSDP2 parameters, the pipeline's receive buffers
    and accumulated gradients included), not only Megatron's."""
    fitting = [
        layout.activation_checkpointing
        for layout in candidate_layouts(row)
        if estimate(row.model, _bundled(layout), GPUS[row.gpu]).fits
    ]
    assert fitting, f"{row.name}: no checkpointing setting fits the bundled trainer"


LLAMA3_405B_8K = [r for r in ROWS if r.model.layers == 126 and r.seq_len == 8192]


def _no_checkpointing(row: PublishedRun, zero_stage: int) -> Layout:
    layout = next(
        layout
        for layout in candidate_layouts(row)
        if layout.activation_checkpointing == "none" and layout.dims.virtual_stages == 1
    )
    return _bundled(layout).replace(zero_stage=zero_stage)


@pytest.mark.parametrize("row", LLAMA3_405B_8K, ids=lambda r: r.name)
def test_llama3_405b_fits_the_bundled_trainer_without_checkpointing(row: PublishedRun) -> None:
    """Meta ran Llama 3 405B at 8K without activation checkpointing (TP 8, PP 16, 80 GB), its
    gradients sharded and reduce-scattered in fp32. The bundled trainer does that from ZeRO-2
    on (pipeline.trainer_stage: every micro-batch's gradients reduce-scattered, its last
    reduce-scatter input released at its end; before, torch's pipelining accumulated the
    stage's unsharded fp32 gradients, 12.1 GiB, and it planned 90.1 / 88.8 GiB), and under
    1F1B its receive buffers are shared among micro-batches (a middle stage held one pair per
    micro-batch, 2.0 GiB). At ZeRO-1, which keeps torch's deferred reduce-scatter, it does not
    fit."""
    gpu = GPUS[row.gpu]
    for zero_stage in (2, 3):
        assert estimate(row.model, _no_checkpointing(row, zero_stage), gpu).fits, zero_stage
    assert not estimate(row.model, _no_checkpointing(row, 1), gpu).fits


HELD_OUT_MISSES = {"llama3-128k-tp8pp16cp16dp8"}
"""Held-out rows the model misses (BENCHMARKS.md, step-time model: held-out published runs:
Llama 3 at 131K, 26 % slow with its all-gather CP timed as Meta ran it). They stay in the
check, strictly expected to fail, so a change that brings them within tolerance must say so
here; they are never fitted on."""


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            r,
            marks=pytest.mark.xfail(
                strict=True, reason="held-out miss, BENCHMARKS.md: held-out published runs"
            ),
        )
        if r.name in HELD_OUT_MISSES
        else r
        for r in ROWS
    ],
    ids=lambda r: r.name,
)
def test_predicted_throughput_is_within_tolerance(row: PublishedRun) -> None:
    error = relative_error(row)
    assert abs(error) <= TOLERANCE, (
        f"{row.name}: predicted {predicted_tflops(row):.0f} TFLOP/s/GPU, published "
        f"{row.tflops_per_gpu:.0f} ({error:+.1%})"
    )


@pytest.mark.parametrize("table", sorted({r.table for r in ROWS}))
def test_the_published_order_is_kept(table: str) -> None:
    rows = [r for r in ROWS if r.table == table]
    predicted = {r.name: predicted_tflops(r) for r in rows}
    for a, b in itertools.combinations(rows, 2):
        if a.tflops_per_gpu > b.tflops_per_gpu * (1 + ORDER_MARGIN):
            assert predicted[a.name] > predicted[b.name], (a.name, b.name)
        elif b.tflops_per_gpu > a.tflops_per_gpu * (1 + ORDER_MARGIN):
            assert predicted[b.name] > predicted[a.name], (a.name, b.name)


def test_the_fit_never_sees_the_held_out_rows() -> None:
    from ctxlaunch.perf.published import FIT_ROWS, HELD_OUT, HELD_OUT_ROWS

    assert {r.name for r in HELD_OUT_ROWS} == HELD_OUT and len(HELD_OUT_ROWS) == 7
    assert not {r.name for r in FIT_ROWS} & HELD_OUT
    assert len(FIT_ROWS) + len(HELD_OUT_ROWS) == len(ROWS)
    # Every table keeps rows on both sides.
    for table in {r.table for r in ROWS}:
        assert any(r.table == table for r in FIT_ROWS)
        assert any(r.table == table for r in HELD_OUT_ROWS)


def test_the_model_is_not_flat() -> None:
    # The check above must be able to fail: halving the network bandwidth slows the CP 16
    # row (its ring crosses nodes) and leaves the CP 1 row at 8K almost untouched.
    cp16, cp1 = ROWS[-1], ROWS[-3]
    slow = {"eta_comm": 0.05}
    assert predicted_tflops(cp16, machine_for(cp16, **slow)) < 0.9 * predicted_tflops(cp16)
    assert predicted_tflops(cp1, machine_for(cp1, **slow)) < predicted_tflops(cp1)


# --------------------------------------------------------------------------------------------
# NeMo's tables give, at each length and GPU count, the layout its authors chose (their
# fastest). `advise` ranks it first at 4K/8K on H100 and 8K/16K on B200; elsewhere the model
# ranks layouts with more CP and less TP first, within a few percent (at most ~9 %) of NeMo's,
# which is inside the model's own accuracy (TOLERANCE): it cannot tell them apart. Why not
# first: the model counts no fixed cost per ring hop (kernel launches, small attention tiles at
# high CP degree) and counts TP collectives as fully exposed, so at equal compute it slightly
# prefers CP to TP; it also offers ZeRO-2/3, which Megatron does not.
def row_spec(row: PublishedRun):  # type: ignore[no-untyped-def]
    from ctxlaunch.contract.loader import validate_spec

    per_node = min(row.gpus, 8)
    m = row.model
    return validate_spec(
        {
            "name": "published-row",
            "model": {
                k: getattr(m, k)
                for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")
            },
            "training": {
                "seq_len": row.seq_len,
                "global_batch": row.global_batch,
                "zero_stage": row.zero_stage,
            },
            "parallel": {"tp": row.dims.tp, "pp": row.dims.pp, "cp": row.dims.cp},
            "cluster": {
                "target": "slurm",
                "nodes": row.gpus // per_node,
                "gpus_per_node": per_node,
                "gpu": row.gpu,
            },
            "fabric": {"network": row.network},
        }
    )


AUTHORS_FIRST = {
    "nemo-h100-4k-tp1pp1cp1dp4",
    "nemo-b200-8k-tp1pp1cp1dp2",
    "nemo-b200-16k-tp1pp1cp1dp4",
}


def _authors_rows() -> list:
    # NeMo's PP 2 row at 8K was a strict xfail while advise planned every layout with the
    # bundled trainer's pipeline buffers (BENCHMARKS.md, the step's peak on the CPU), which
    # NeMo does not hold; on a Megatron-profile machine advise now plans Megatron's memory habits
    # (planning.advise, Layout.framework), so it is checked like the others.
    return [r for r in ROWS if r.table.startswith("nemo")]


@pytest.mark.parametrize("row", _authors_rows(), ids=lambda r: r.name)
def test_the_authors_layout_ranks_first_or_within_the_models_accuracy(row: PublishedRun) -> None:
    from ctxlaunch.perf.machine import machine_for as spec_machine
    from ctxlaunch.planning.advise import advise

    spec = row_spec(row)
    advice = advise(
        spec, matmul_precision=row.precision, machine=spec_machine(spec, framework="megatron")
    )

    def degrees(d: ParallelDims) -> tuple:
        return (d.tp, d.pp, d.cp, d.dp, d.cp_algorithm, d.ulysses_degree)

    ranks = [i for i, c in enumerate(advice.ranked) if degrees(c.layout.dims) == degrees(row.dims)]
    assert ranks, f"{row.name}: the published layout is not among the ranked ones"
    ours = advice.ranked[ranks[0]]
    gap = ours.time.step_seconds / advice.ranked[0].time.step_seconds - 1
    assert gap <= TOLERANCE, f"{row.name}: rank {ranks[0] + 1}, {gap:+.1%} slower than the top"
    if row.name in AUTHORS_FIRST:
        assert ranks[0] == 0
