"""The planner's peak of a mixture-of-experts model (`memory.peak` with ctxlaunch.perf.moecost's
terms) against the allocator's own peak: the trainer's real steps (two, so AdamW's states
exist) on the CPU, every allocation and free from the torch profiler's memory events
(`memtrace.measure_training_peak`), as tests/unit/test_memory_peak.py checks the dense model.

The shape (2 blocks, h 256, 8 experts of 256, top-2, vocab 256) keeps the weights small next to
the activations at 4,096 tokens. Modelled: what the router and the experts save, the combine's
backward (the step's peak), recomputation under checkpointing, the autocast copies of the
experts, the optimizer step. Under expert parallelism the routings a rank's experts receive
depend on the routing: each rank is planned at the load it measured (the routings its experts
received over its share, `moe.planned_load`), which is what the planner's admitted load stands
for. Held to 2 %."""

from __future__ import annotations

from typing import Any

import pytest

from ctxlaunch.contract.loader import apply_overrides, validate_spec
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.memory import peak
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.distributed

BASE = {
    "name": "moe-peak",
    "model": {
        "family": "qwen3_moe",
        "layers": 2,
        "hidden": 256,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 32,
        "ffn_hidden": 704,
        "vocab": 256,
        "dtype": "fp32",
        "moe": {"experts": 8, "experts_per_token": 2, "ffn_hidden": 256, "norm_topk_prob": True},
    },
    "training": {"seq_len": 4096, "micro_batch": 1, "global_batch": 1, "steps": 2, "seed": 7},
    "parallel": {"cp": 1},
    "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
}


def spec_for(world: int, changes: dict[str, object]) -> dict:
    data = apply_overrides(
        BASE, [f"cluster.gpus_per_node={world}"] + [f"{k}={v}" for k, v in changes.items()]
    )
    return validate_spec(data).model_dump(mode="json")


def _measure(rank: int, world: int, specs: list[dict]) -> list[tuple[int, float]]:
    """Each spec's measured peak on this rank, and the routing load its experts received in
    step 2 (rows received over the rank's own routings, every layer)."""
    from ctxlaunch.runtime.modeling.moe import Experts
    from ctxlaunch.runtime.parallel.context import build_context
    from devkit.memtrace import measure_training_peak

    out = []
    for data in specs:
        spec = validate_spec(data)
        received: list[int] = []
        forward = Experts.forward

        def counting(self: Experts, rows: Any, counts: list[int]) -> Any:
            received.append(sum(counts))
            return forward(self, rows, counts)

        Experts.forward = counting  # type: ignore[method-assign]
        # counts the rows, then runs the real thing: a measurement, not a stand-in
        try:
            trace = measure_training_peak(spec, build_context(spec.parallel_dims, rank=rank))
        finally:
            Experts.forward = forward  # type: ignore[method-assign]
        layout = Layout.from_spec(spec)
        assert spec.model.moe is not None
        own = spec.model.moe.experts_per_token * layout.tokens_per_rank / layout.dims.tp
        step_two = received[len(received) // 2 :][: spec.model.layers]
        out.append((trace.peak_bytes, sum(step_two) / (len(step_two) * own)))
    return out


def _errors(world: int, specs: list[dict], ranks: list[list[tuple[int, float]]]) -> list[float]:
    """predicted / measured - 1 of each case, each rank planned at the routing load it
    measured; prints every reading. The record can only read high (a free it missed keeps a
    block on the curve until its address is handed out again: the all-to-all's send buffers
    are released on gloo's threads), and the ranks of an EP group make allocations of nearly
    the same sizes (their loads a few percent apart, planned apart), so a case is compared
    through the rank whose reading is closest to its plan."""
    from ctxlaunch.runtime.data.batches import SyntheticTokens

    worst = []
    for index, data in enumerate(specs):
        spec = validate_spec(data)
        layout = Layout.from_spec(spec)
        t = spec.training
        chain = SyntheticTokens(spec.model.vocab, t.seq_len, t.seed).chain.nbytes
        errors = []
        for rank in range(world):
            measured, load = ranks[rank][index]
            assert spec.model.moe is not None
            moe = spec.model.moe.model_copy(update={"planned_load": max(load, 1.0)})
            phase = peak(spec.model.model_copy(update={"moe": moe}), layout)
            predicted = phase.total + chain
            errors.append(predicted / measured - 1)
            print(
                f"{data['parallel']} {data['model']['dtype']} "
                f"{data['training']['activation_checkpointing']} rank {rank}: load {load:.3f} "
                f"predicted {predicted:,.0f} ({phase.name}) measured {measured:,} "
                f"{errors[-1]:+.2%}"
            )
        worst.append(max(errors))
    return worst


@pytest.mark.timeout(600)
def test_moe_peak_within_2_percent_one_process() -> None:
    """bf16 (autocast: the experts' 16-bit copies) and fp32, checkpointing none, selective and
    full (the recomputed feed-forward's input too; at 4,096 tokens, where the activations
    outweigh the experts' recomputed 16-bit copies, which the plan does not follow closely
    at shorter lengths)."""
    cases = [
        {"model.dtype": "bf16", "training.seq_len": 2048},
        {"training.activation_checkpointing": "selective", "training.seq_len": 2048},
        {"model.dtype": "bf16", "training.activation_checkpointing": "full"},
    ]
    specs = [spec_for(1, case) for case in cases]
    errors = _errors(1, specs, [_measure(0, 1, specs)])
    assert all(abs(e) <= 0.02 for e in errors), errors


@pytest.mark.timeout(600)
def test_moe_peak_within_2_percent_at_cp_2_x_ep_2() -> None:
    """CP 2 x EP 2: each rank's experts hold the rows the all-to-all brought (planned at the
    load it measured)."""
    specs = [spec_for(2, {"parallel.cp": 2, "parallel.ep": 2})]
    errors = _errors(2, specs, run_distributed(_measure, 2, specs, timeout_s=500))
    assert all(abs(e) <= 0.02 for e in errors), errors
