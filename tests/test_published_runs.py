"""The step-time model against published runs no one here measured.

Every row is a layout its authors ran, with the throughput they published, held as data with its
source. One tolerance for every row (`TOLERANCE`), never tuned per row. Two efficiencies of the
model (steptime.ETA_MATMUL, ETA_ATTENTION) are fitted on these rows as a whole
(benchmarks/fit_steptime.py); everything else is a data-sheet value.

What the sources do not state (activation checkpointing, virtual pipeline stages) is taken as
the fastest setting that the planner says fits (with its measured error as headroom), the
published TP/CP/PP/DP held: one rule for every row, the question `advise` answers. The planner is asked about Megatron's memory habits
(`framework="megatron"`: bf16 weights, no gathered copies kept under TP), not the bundled
trainer's, since every row ran on Megatron-LM/NeMo or Meta's own stack.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from ctxlaunch.contract.hardware import GPUS
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.flops import flops_per_token
from ctxlaunch.perf.memory import MemoryEstimate, estimate
from ctxlaunch.perf.steptime import Machine, StepLayout, StepTime, predict

TOLERANCE = 0.15
"""Predicted throughput within 15 % of the published one, for every row."""
ORDER_MARGIN = 0.10
"""Rows of one table whose published throughputs differ by more than this must be predicted in
the same order (closer ones are within the tables' own run-to-run spread)."""

NEMO = ("NVIDIA NeMo, docs/source/performance/performance_long_sequence.md "
        "(github.com/NVIDIA/NeMo, commit 8cfedd72); TFLOPS/GPU counted by NeMo's formula of the "
        "time (full score matrix: the causal discount came in NeMo PR #14424, Aug 2025)")
NEMO_H100 = NEMO + ", LLAMA2-7B (FP8), DGX-H100, NeMo 24.03.01"
NEMO_B200 = (NEMO + ", LLAMA3-8B (FP8), DGX-B200, NeMo 25.04.rc2; the table's '# of GPUs' "
             "column is misprinted: TP x CP x DP is the count used here")
LLAMA3 = ("Llama Team, AI @ Meta, 'The Llama 3 Herd of Models', arXiv:2407.21783, Table 4 "
          "(405B pre-training on H100 80GB over 400 Gb/s RoCE, BF16); also "
          "../shared/docs/domain.md")

LLAMA2_7B = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008,
                      vocab=32000)
LLAMA3_8B = ModelSpec(preset="llama3-8b")
LLAMA3_405B = ModelSpec(preset="llama3-405b")


@dataclass(frozen=True)
class PublishedRun:
    table: str
    model: ModelSpec
    gpu: str
    network: str
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    tp: int
    pp: int
    cp: int
    dp: int
    precision: str
    tflops_per_gpu: float
    convention: str
    """Which MFU convention the source's TFLOP/s count (see ctxlaunch.perf.flops)."""
    zero_stage: int
    source: str

    @property
    def name(self) -> str:
        return f"{self.table}-{self.seq_len // 1024}k-tp{self.tp}pp{self.pp}cp{self.cp}dp{self.dp}"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tflops_per_gpu * 1e12 / flops_per_token(self.model, self.seq_len,
                                                            self.convention)


def _nemo(table, model, gpu, seq_k, batch, tp, pp, dp, cp, tflops, source):  # type: ignore[no-untyped-def]
    # NeMo's Megatron runs use the distributed optimizer (ZeRO-1) over 400 Gb/s InfiniBand.
    return PublishedRun(table, model, gpu, "infiniband-ndr", seq_k * 1024, batch, tp, pp, cp, dp,
                        "fp8", tflops, "full", 1, source)


ROWS: list[PublishedRun] = [
    # NeMo, LLAMA2-7B FP8 on DGX-H100: SeqLen (K), batch, TP, PP, DP, CP, TFLOPS/GPU with CP.
    _nemo("nemo-h100", LLAMA2_7B, "H100", 4, 1024, 1, 1, 4, 1, 768, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 8, 512, 1, 2, 4, 1, 730, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 16, 256, 2, 1, 8, 1, 660, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 32, 128, 2, 1, 8, 2, 610, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 64, 64, 4, 1, 8, 2, 574, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 128, 32, 4, 1, 8, 4, 555, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 256, 16, 4, 1, 8, 8, 549, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 512, 8, 8, 1, 4, 16, 549, NEMO_H100),
    _nemo("nemo-h100", LLAMA2_7B, "H100", 1024, 4, 8, 1, 4, 32, 536, NEMO_H100),
    # NeMo, LLAMA3-8B FP8 on DGX-B200.
    _nemo("nemo-b200", LLAMA3_8B, "B200", 8, 512, 1, 1, 2, 1, 1671, NEMO_B200),
    _nemo("nemo-b200", LLAMA3_8B, "B200", 16, 256, 1, 1, 4, 1, 1717, NEMO_B200),
    _nemo("nemo-b200", LLAMA3_8B, "B200", 32, 128, 1, 1, 4, 2, 1624, NEMO_B200),
    _nemo("nemo-b200", LLAMA3_8B, "B200", 64, 64, 1, 1, 4, 4, 1600, NEMO_B200),
    _nemo("nemo-b200", LLAMA3_8B, "B200", 128, 32, 2, 1, 4, 4, 1588, NEMO_B200),
    _nemo("nemo-b200", LLAMA3_8B, "B200", 256, 16, 4, 1, 4, 4, 1590, NEMO_B200),
    _nemo("nemo-b200", LLAMA3_8B, "B200", 512, 8, 4, 1, 4, 8, 1619, NEMO_B200),
    _nemo("nemo-b200", LLAMA3_8B, "B200", 1024, 4, 4, 1, 4, 16, 1608, NEMO_B200),
    # Llama 3 405B, Table 4: GPUs, TP, CP, PP, DP, seq, batch size/DP, TFLOPs/GPU. 16M tokens
    # per batch. Meta does not state the attention convention; at 8K it moves the figure by
    # under 5 %, at 131K by 1.4x: "causal" is the reading under which 380 TFLOP/s at 131K is
    # consistent with 400 at 8K on the same GPUs (see the README's discussion). FSDP sharding
    # optimizer states and gradients, weights kept after forward: ZeRO-2.
    PublishedRun("llama3", LLAMA3_405B, "H100", "roce", 8192, 32 * 64, 8, 16, 1, 64, "bf16",
                 430, "causal", 2, LLAMA3),
    PublishedRun("llama3", LLAMA3_405B, "H100", "roce", 8192, 16 * 128, 8, 16, 1, 128, "bf16",
                 400, "causal", 2, LLAMA3),
    PublishedRun("llama3", LLAMA3_405B, "H100", "roce", 131072, 16 * 8, 8, 16, 16, 8, "bf16",
                 380, "causal", 2, LLAMA3),
]

CHECKPOINTING = ("none", "selective", "full")
VIRTUAL_STAGES = (1, 2, 4, 8)


def machine_for(row: PublishedRun, **changes: object) -> Machine:
    return Machine.from_gpu(GPUS[row.gpu], network=row.network, gpus_per_node=8, **changes)


def candidate_layouts(row: PublishedRun) -> list[StepLayout]:
    """The published layout with every setting the source leaves open."""
    base = StepLayout(seq_len=row.seq_len, micro_batch=1, grad_accum=row.global_batch // row.dp,
                      tp=row.tp, pp=row.pp, cp=row.cp, dp=row.dp, cp_algorithm="ring",
                      zero_stage=row.zero_stage, dtype="bf16", matmul_precision=row.precision)
    out = []
    # Llama 3's 126 layers over 16 stages are uneven (Meta drops a layer from the first and
    # the last stage), so chunks are not required to be equal here; at most a layer each.
    stage_layers = row.model.layers // row.pp
    for mode, v in itertools.product(CHECKPOINTING, VIRTUAL_STAGES):
        if v > 1 and (row.pp == 1 or v > stage_layers):
            continue
        out.append(base.replace(activation_checkpointing=mode, virtual_stages=v))
    return out


PLANNER_MARGIN = 0.15
"""Headroom a setting must leave to count as fitting a published run: the planner's own
error measured on a real GPU (it read 13-15 % low at 64K tokens on the H200, BENCHMARKS.md
section 0). A setting that fits only inside that error is not one its authors could rely on."""


def _fits_with_margin(estimate_: MemoryEstimate) -> bool:
    return estimate_.total <= (1 - PLANNER_MARGIN) * estimate_.capacity


def best_fitting(row: PublishedRun, machine: Machine) -> tuple[StepLayout, StepTime] | None:
    """The fastest of the row's candidate layouts that the planner says fits."""
    gpu = GPUS[row.gpu]
    fitting = [(layout, predict(row.model, layout, machine)) for layout in candidate_layouts(row)
               if _fits_with_margin(estimate(row.model,
                                             layout.memory().replace(framework="megatron"), gpu))]
    return min(fitting, key=lambda pair: pair[1].step_seconds) if fitting else None


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
    assert [r.gpus for r in ROWS if r.table == "nemo-h100"] == [4, 8, 16, 32, 64, 128, 256, 512,
                                                                1024]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_every_published_layout_is_predicted_to_fit(row: PublishedRun) -> None:
    assert best_fitting(row, machine_for(row)) is not None


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_predicted_throughput_is_within_tolerance(row: PublishedRun) -> None:
    error = relative_error(row)
    assert abs(error) <= TOLERANCE, (
        f"{row.name}: predicted {predicted_tflops(row):.0f} TFLOP/s/GPU, published "
        f"{row.tflops_per_gpu:.0f} ({error:+.1%})")


@pytest.mark.parametrize("table", sorted({r.table for r in ROWS}))
def test_the_published_order_is_kept(table: str) -> None:
    rows = [r for r in ROWS if r.table == table]
    predicted = {r.name: predicted_tflops(r) for r in rows}
    for a, b in itertools.combinations(rows, 2):
        if a.tflops_per_gpu > b.tflops_per_gpu * (1 + ORDER_MARGIN):
            assert predicted[a.name] > predicted[b.name], (a.name, b.name)
        elif b.tflops_per_gpu > a.tflops_per_gpu * (1 + ORDER_MARGIN):
            assert predicted[b.name] > predicted[a.name], (a.name, b.name)


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
    return validate_spec({
        "name": "published-row",
        "model": {k: getattr(m, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                             "ffn_hidden", "vocab")},
        "training": {"seq_len": row.seq_len, "global_batch": row.global_batch,
                     "zero_stage": row.zero_stage},
        "parallel": {"tp": row.tp, "pp": row.pp, "cp": row.cp},
        "cluster": {"target": "slurm", "nodes": row.gpus // per_node,
                    "gpus_per_node": per_node, "gpu": row.gpu},
        "fabric": {"network": row.network}})


AUTHORS_FIRST = {"nemo-h100-4k-tp1pp1cp1dp4", "nemo-b200-8k-tp1pp1cp1dp2",
                 "nemo-b200-16k-tp1pp1cp1dp4"}


@pytest.mark.parametrize("row", [r for r in ROWS if r.table.startswith("nemo")],
                         ids=lambda r: r.name)
def test_the_authors_layout_ranks_first_or_within_the_models_accuracy(
        row: PublishedRun) -> None:
    from ctxlaunch.planning.advise import Degrees, advise

    advice = advise(row_spec(row), matmul_precision=row.precision)
    published = Degrees(row.tp, row.pp, row.cp, row.dp, "ring", 1)
    ranks = [i for i, c in enumerate(advice.ranked) if c.degrees == published]
    assert ranks, f"{row.name}: the published layout is not among the ranked ones"
    ours = advice.ranked[ranks[0]]
    gap = ours.time.step_seconds / advice.ranked[0].time.step_seconds - 1
    assert gap <= TOLERANCE, f"{row.name}: rank {ranks[0] + 1}, {gap:+.1%} slower than the top"
    if row.name in AUTHORS_FIRST:
        assert ranks[0] == 0
