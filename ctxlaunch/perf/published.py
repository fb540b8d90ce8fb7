"""Published training runs no one here measured, read from their data file
(fitted/published-runs.json, each table with its source): what the Megatron profile's two GEMM
efficiencies (ctxlaunch.perf.profiles.MEGATRON_ETA_MATMUL) are fitted on (FIT_ROWS only,
benchmarks/fit_steptime.py) and what every row, held out or not, is checked against
(tests/unit/test_published_runs.py).

What the sources do not state (activation checkpointing, virtual pipeline stages) is taken as
the fastest setting that the planner says fits (with its measured error as headroom), the
published TP/CP/PP/DP held: one rule for every row, the question `advise` answers. The planner
is asked about Megatron's memory habits (`framework="megatron"`: bf16 weights, no gathered
copies kept under TP), not the bundled trainer's, since every row ran on Megatron-LM/NeMo or
Meta's own stack.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxlaunch.contract.hardware import GPUS
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.flops import MfuConvention, flops_per_token
from ctxlaunch.perf.layout import Layout, MatmulPrecision
from ctxlaunch.perf.machine import Machine
from ctxlaunch.perf.memory import MemoryEstimate, estimate
from ctxlaunch.perf.steptime import StepTime, predict

DATA_FILE = Path(__file__).resolve().parent / "fitted" / "published-runs.json"
"""The rows, their tables' sources and the held-out set."""


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its model, machine, layout and measured throughput."""

    table: str
    """The source table the row comes from (its key in the data file)."""
    model: ModelSpec
    gpu: str
    network: str
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    dims: ParallelDims
    """The published degrees (TP, PP, CP, DP) and how the source ran CP: a ring
    (Megatron/Transformer Engine's p2p ring, NeMo's default) or all-gather (Llama 3)."""
    precision: MatmulPrecision
    tflops_per_gpu: float
    convention: MfuConvention
    """Which MFU convention the source's TFLOP/s count (see ctxlaunch.perf.flops)."""
    zero_stage: int
    source: str

    @property
    def name(self) -> str:
        """The row's id: table, length and layout."""
        d = self.dims
        return f"{self.table}-{self.seq_len // 1024}k-tp{d.tp}pp{d.pp}cp{d.cp}dp{d.dp}"

    @property
    def gpus(self) -> int:
        return self.dims.world_size

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return (
            self.tflops_per_gpu * 1e12 / flops_per_token(self.model, self.seq_len, self.convention)
        )


def _read_rows() -> tuple[list[PublishedRun], frozenset[str]]:
    """Every row of the data file, and the names of the held-out ones."""
    data = json.loads(DATA_FILE.read_text())
    # Through model_validate: a preset fills in the rest of the fields.
    models = {name: ModelSpec.model_validate(shape) for name, shape in data["models"].items()}
    rows = []
    for row in data["rows"]:
        table = data["tables"][row["table"]]
        rows.append(
            PublishedRun(
                table=row["table"],
                model=models[table["model"]],
                gpu=table["gpu"],
                network=table["network"],
                seq_len=row["seq_len"],
                global_batch=row["global_batch"],
                dims=ParallelDims(
                    tp=row["tp"],
                    pp=row["pp"],
                    cp=row["cp"],
                    dp=row["dp"],
                    cp_algorithm=row.get("cp_algorithm", "ring"),
                ),
                precision=table["precision"],
                tflops_per_gpu=row["tflops_per_gpu"],
                convention=table["convention"],
                zero_stage=table["zero_stage"],
                source=table["source"],
            )
        )
    return rows, frozenset(data["held_out"])


ROWS, HELD_OUT = _read_rows()
"""Every published row, and the names of the rows the fit never sees (benchmarks/
fit_steptime.py fits on FIT_ROWS only; the data file says which and why). Their errors are
reported on their own and set the Megatron profile's expected error."""
FIT_ROWS = [r for r in ROWS if r.name not in HELD_OUT]
HELD_OUT_ROWS = [r for r in ROWS if r.name in HELD_OUT]

CHECKPOINTING = ("none", "selective", "full")
VIRTUAL_STAGES = (1, 2, 4, 8)


def row_machine(row: PublishedRun, **changes: Any) -> Machine:
    """The data-sheet machine a row ran on (eight GPUs a node), with `changes`."""
    return Machine.from_gpu(
        GPUS[row.gpu], network=row.network, gpus_per_node=8, framework="megatron", **changes
    )


def candidate_layouts(row: PublishedRun) -> list[Layout]:
    """The published layout with every setting the source leaves open, planned with
    Megatron's memory habits."""
    base = Layout(
        seq_len=row.seq_len,
        dims=row.dims,
        micro_batch=1,
        grad_accum=row.global_batch // row.dims.dp,
        zero_stage=row.zero_stage,
        dtype="bf16",
        matmul_precision=row.precision,
        framework="megatron",
    )
    out = []
    # Llama 3's 126 layers over 16 stages are uneven (Meta drops a layer from the first and
    # the last stage), so chunks are not required to be equal here; at most a layer each.
    stage_layers = row.model.layers // row.dims.pp
    for mode, v in itertools.product(CHECKPOINTING, VIRTUAL_STAGES):
        if v > 1 and (row.dims.pp == 1 or v > stage_layers):
            continue
        out.append(base.with_dims(virtual_stages=v).replace(activation_checkpointing=mode))
    return out


PLANNER_MARGIN = 0.15
"""Headroom a setting must leave to count as fitting a published run: the planner's own
error measured on a real GPU (it read 13-15 % low at 64K tokens on an H200). A setting that
fits only inside that error is not one its authors could rely on."""


def _fits_with_margin(estimate_: MemoryEstimate) -> bool:
    """Whether a setting fits with the planner's measured error as headroom."""
    return estimate_.total <= (1 - PLANNER_MARGIN) * estimate_.capacity


def best_fitting(row: PublishedRun, machine: Machine) -> tuple[Layout, StepTime] | None:
    """The fastest of the row's candidate layouts that the planner says fits."""
    gpu = GPUS[row.gpu]
    fitting = [
        (layout, predict(row.model, layout, machine))
        for layout in candidate_layouts(row)
        if _fits_with_margin(estimate(row.model, layout, gpu))
    ]
    return min(fitting, key=lambda pair: pair[1].step_seconds) if fitting else None
