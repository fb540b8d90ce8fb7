"""The memory and FLOPs models: hand-computed values, DeepSpeed's own estimators, and the
searches' invariants."""

from __future__ import annotations

import pytest

from ctxlaunch.contract.hardware import GPUS, GiB
from ctxlaunch.contract.loader import load_spec, validate_spec
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.flops import count_params, flops_per_token, mfu
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.memory import (
    block_activation_bytes_per_token,
    estimate,
    longest_sequence,
    model_state_bytes,
    sequence_granularity,
)
from ctxlaunch.planning.plan import plan_job
from tests.helpers.paths import JOBS

LLAMA_8B = ModelSpec(preset="llama3-8b")
LLAMA_70B = ModelSpec(preset="llama3-70b")
H100 = GPUS["H100"]


def test_parameter_counts_match_the_released_models() -> None:
    assert count_params(LLAMA_8B).total == 8_030_261_248
    assert count_params(LLAMA_70B).total == 70_553_706_496
    # The input embedding is a lookup, not a matmul.
    assert count_params(LLAMA_8B).matmul == 8_030_261_248 - 128256 * 4096
    tied = ModelSpec(preset="llama3.2-1b")
    assert count_params(tied).head == 0
    assert count_params(tied).matmul == count_params(tied).total  # the table is the head


@pytest.mark.parametrize(
    "model, seq", [(LLAMA_8B, 8192), (LLAMA_8B, 131072), (LLAMA_70B, 8192), (LLAMA_70B, 131072)]
)
def test_flops_per_token_by_hand(model: ModelSpec, seq: int) -> None:
    n = count_params(model).matmul
    full = 6 * n + 12 * model.layers * model.hidden * seq
    causal = 6 * n + 6 * model.layers * model.hidden * seq
    assert flops_per_token(model, seq, "full") == pytest.approx(full, rel=1e-12)
    assert flops_per_token(model, seq, "causal") == pytest.approx(causal, rel=1e-12)
    assert full / causal < 2


def test_attention_dominates_at_long_context() -> None:
    # At 128K the two conventions differ by ~1.5x for 8B: the reason to report both.
    ratio = flops_per_token(LLAMA_8B, 131072, "full") / flops_per_token(LLAMA_8B, 131072, "causal")
    assert 1.6 < ratio < 1.8
    assert (
        flops_per_token(LLAMA_8B, 8192, "full") / flops_per_token(LLAMA_8B, 8192, "causal") < 1.15
    )


def test_mfu_by_hand() -> None:
    # 8B at 8K: 6 * 7.5e9 + 12 * 32 * 4096 * 8192 = 5.79e10 FLOPs/token; 3,000 tokens/s/GPU
    # on a 989 TFLOP/s H100 is 17.6 % MFU.
    per_token = 6 * count_params(LLAMA_8B).matmul + 12 * 32 * 4096 * 8192
    assert mfu(3000, LLAMA_8B, 8192, 989e12, "full") == pytest.approx(3000 * per_token / 989e12)
    assert mfu(3000, LLAMA_8B, 8192, 989e12, "full") == pytest.approx(0.1756, abs=1e-4)
    with pytest.raises(ValueError):
        mfu(1, LLAMA_8B, 8192, 0, "full")


def test_block_activation_constant_for_llama3_8b() -> None:
    # 2*r*h + a*(5h + 2h_kv + 3f) + 4*heads + 8 with a = r = 2 (bf16 under DeepSpeed).
    layout = Layout(seq_len=8192, dtype="bf16", zero_stage=2)
    per_token = block_activation_bytes_per_token(LLAMA_8B, layout)
    assert per_token == 2 * 2 * 4096 + 2 * (5 * 4096 + 2 * 1024 + 3 * 14336) + 4 * 32 + 8
    assert per_token == 147_592  # ~36 h, next to Korthikanti's 34 h for a GPT block
    # ZeRO-0 bf16 runs under autocast: the residual stream is fp32.
    assert (
        block_activation_bytes_per_token(LLAMA_8B, layout.replace(zero_stage=0))
        == per_token + 2 * 2 * 4096
    )
    selective = block_activation_bytes_per_token(
        LLAMA_8B, layout.replace(activation_checkpointing="selective")
    )
    full = block_activation_bytes_per_token(
        LLAMA_8B, layout.replace(activation_checkpointing="full")
    )
    assert full == 2 * 4096 and full < selective < per_token


def test_activations_divide_by_cp_and_tp() -> None:
    base = Layout(seq_len=131072, dtype="bf16", zero_stage=2)
    one = estimate(LLAMA_8B, base, H100).activations
    for n in (2, 4, 8):
        assert estimate(LLAMA_8B, base.with_dims(cp=n), H100).activations == pytest.approx(
            one / n, rel=1e-6
        )
    # TP (sequence parallel) divides everything but what is gathered over the TP group outside
    # the blocks: the gradient of the loss input (fp32), the RoPE tables and the int64 ids. The
    # norm outputs the column-parallel projections read are kept as local shards (gathered
    # again in backward), so they divide like the rest.
    # (ZeRO-0: with TP, ZeRO >= 1 runs through FSDP2, fp32 weights and residual either way.)
    plain = base.replace(zero_stage=0)
    tp4 = estimate(LLAMA_8B, plain.with_dims(tp=4), H100).activations
    h, hd, tokens = LLAMA_8B.hidden, LLAMA_8B.head_dim, 131072
    gathered = tokens * (1 - 1 / 4) * (4 * h + 2 * hd * 2 + 8)
    assert tp4 == pytest.approx(
        estimate(LLAMA_8B, plain, H100).activations / 4 + gathered + tokens * 1, rel=1e-6
    )


@pytest.mark.parametrize(
    "stage, per_param",
    [
        (0, (4, 4, 8)),
        (1, (2, 2, 16 / 32)),
        (2, (2, 2 / 32, 16 / 32)),
    ],
)
def test_model_states_per_zero_stage(stage: int, per_param: tuple) -> None:
    p = 1_000_000_000
    got = model_state_bytes(p, 0, stage, 32, "bf16")
    assert got == tuple(int(x * p) for x in per_param)


def test_model_states_match_deepspeed_estimators() -> None:
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.stage_1_and_2 as stage2

    from ctxlaunch.perf.memory import largest_layer_params, params_per_rank

    for nodes, per_node in ((1, 8), (4, 8), (16, 8)):
        gpus = nodes * per_node
        params = params_per_rank(LLAMA_8B, 1, 1)
        _, ds_zero2 = stage2.estimate_zero2_model_states_mem_needs(
            params, per_node, nodes, cpu_offload=False
        )
        assert sum(model_state_bytes(params, 0, 2, gpus, "bf16")) == pytest.approx(ds_zero2, abs=2)
        largest = largest_layer_params(LLAMA_8B)
        _, ds_zero3, _ = stage3.estimate_zero3_model_states_mem_needs(
            params, largest, per_node, nodes, cpu_offload=False, cpu_offload_params=False
        )
        assert sum(model_state_bytes(params, largest, 3, gpus, "bf16")) == pytest.approx(
            ds_zero3, abs=3
        )


def test_longest_sequence_is_the_boundary() -> None:
    layout = Layout(
        seq_len=8192,
        dtype="bf16",
        zero_stage=2,
        activation_checkpointing="selective",
        dims=ParallelDims(dp=4, cp=8),
    )
    longest = longest_sequence(LLAMA_8B, layout, H100)
    unit = sequence_granularity(8)
    assert longest % unit == 0 and longest > 0
    assert estimate(LLAMA_8B, layout.replace(seq_len=longest), H100).fits
    assert not estimate(LLAMA_8B, layout.replace(seq_len=longest + unit), H100).fits


def test_memory_grows_with_sequence_and_shrinks_with_cp() -> None:
    layout = Layout(seq_len=32768, dtype="bf16", zero_stage=1, dims=ParallelDims(dp=2))
    totals = [
        estimate(LLAMA_8B, layout.replace(seq_len=s), H100).total for s in (8192, 32768, 131072)
    ]
    assert totals == sorted(totals)
    by_cp = [estimate(LLAMA_8B, layout.with_dims(cp=n), H100).total for n in (1, 2, 4, 8)]
    assert by_cp == sorted(by_cp, reverse=True)


def test_llama3_8b_example_plan() -> None:
    report = plan_job(load_spec(JOBS / "llama3-8b-128k-slurm.yaml"))
    e = report.estimate
    assert e.fits and report.smallest_fitting_cp.dims.cp == 8
    assert e.parameters == 2 * 8_030_261_248  # ZeRO-2 keeps bf16 weights whole
    # 131072 / 8 tokens per rank x 32 layers x selective per-token bytes
    layout = report.layout
    per_block = block_activation_bytes_per_token(LLAMA_8B, layout)
    # outside the blocks: the final norm's input and rstd, the gradient of the loss input,
    # token ids, RoPE tables
    assert e.activations == int(16384 * (per_block * 32 + 2 * 2 * 4096 + 4 + 8 + 2 * 128 * 2))
    assert [o.dims.cp for o in report.cp_options if o.fits][0] == 8
    assert report.to_dict()["memory"]["fits"] is True


def test_not_fitting_says_by_how_much_and_what_fits() -> None:
    spec = load_spec(
        JOBS / "llama3-8b-128k-slurm.yaml", ["parallel.cp=2", "training.global_batch=null"]
    )
    report = plan_job(spec)
    assert not report.fits
    verdict = report.verdict()
    assert "does not fit" in verdict and "GiB over" in verdict
    assert "cp = 8 (128 GPUs on 16 nodes)" in verdict
    assert report.suggestions and all(s.estimate.fits for s in report.suggestions)


def test_ulysses_options_beyond_kv_heads_are_not_legal() -> None:
    spec = validate_spec(
        {
            "name": "u",
            "model": "llama3-8b",
            "training": {"seq_len": 65536},
            "parallel": {"cp": 8, "cp_algorithm": "ulysses"},
            "cluster": {"target": "slurm", "nodes": 1, "gpus_per_node": 8},
        }
    )
    options = {o.dims.cp: o for o in plan_job(spec).cp_options}
    assert options[8].legal and not options[16].legal
    assert "hybrid" in options[16].reason


def test_capacity_comes_from_the_gpu_table() -> None:
    assert GPUS["H200"].memory_bytes > GPUS["H100"].memory_bytes > 79 * GiB
    assert GPUS["L40S"].nvlink is False


def test_uneven_stages_plan_the_busiest_stage() -> None:
    """405B at PP 16: the balanced split (7, 8 x 14, 7) puts 8 blocks on the middle stages and
    7 beside the embedding / head; params and activations are those of the busiest rank."""
    from ctxlaunch.perf.memory import activation_bytes, params_per_rank

    model = ModelSpec(preset="llama3-405b")
    counts = count_params(model)
    split = (7,) + (8,) * 14 + (7,)
    layout = Layout(seq_len=8192, grad_accum=16, stage_layers=split, dims=ParallelDims(tp=8, pp=16))
    held = params_per_rank(model, 8, 16, layout.rank_layers(model.layers))
    want = max(
        7 * counts.per_layer + counts.embedding,
        8 * counts.per_layer,
        7 * counts.per_layer + counts.final_norm + counts.head,
    )
    assert held == -(-want // 8)
    # 1F1B: rank r holds 16 - r micro-batches in flight; each is one pp = 1 model of its
    # blocks (rank 0: 16 x 7 blocks, rank 1: 15 x 8, the busiest).
    from ctxlaunch.perf.memory import stage_activation_bytes

    def stage(r: int) -> float:
        return stage_activation_bytes(model, layout, split[r], first=r == 0, last=r == 15)

    want_act = max((16 - r) * stage(r) for r in range(16))
    assert want_act == 15 * stage(1)
    assert activation_bytes(model, layout) == pytest.approx(want_act, rel=1e-12)
    assert layout.rank_layers(model.layers) == list(split)
