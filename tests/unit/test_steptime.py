"""The step-time model's terms, each against the arithmetic it stands for."""

from __future__ import annotations

import json
import statistics

import pytest

from ctxlaunch.contract.hardware import GPUS
from ctxlaunch.contract.loader import load_spec
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf import profiles
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import GpuCalibration, Machine
from ctxlaunch.perf.steptime import predict, predict_spec
from tests.helpers.paths import JOBS, ROOT

LLAMA_8B = ModelSpec(preset="llama3-8b")
H100_NDR = Machine.from_gpu(GPUS["H100"], network="infiniband-ndr", gpus_per_node=8)


def test_terms_add_up_and_mfu_uses_both_conventions() -> None:
    st = predict(
        LLAMA_8B, Layout(seq_len=65536, grad_accum=2, dims=ParallelDims(cp=8, dp=4)), H100_NDR
    )
    assert st.step_seconds == pytest.approx(sum(st.terms.values()))
    assert st.tokens_per_second_per_gpu == pytest.approx(65536 * 2 * 4 / st.step_seconds / 32)
    assert st.mfu["full"] > st.mfu["causal"] > 0
    assert st.mfu["full"] == pytest.approx(
        st.model_flops_per_second_per_gpu["full"] / GPUS["H100"].peak_bf16_flops
    )


def test_fp8_runs_the_matmuls_at_twice_the_peak() -> None:
    layout = Layout(seq_len=8192, dims=ParallelDims(dp=8))
    bf16 = predict(LLAMA_8B, layout, H100_NDR)
    fp8 = predict(LLAMA_8B, layout.replace(matmul_precision="fp8"), H100_NDR)
    eta = H100_NDR.eta_matmul
    assert fp8.terms["compute_matmul"] == pytest.approx(
        bf16.terms["compute_matmul"] * eta["bf16"] / (2 * eta["fp8"])
    )
    assert fp8.terms["compute_attention"] == bf16.terms["compute_attention"]


def test_ring_transfer_is_exposed_only_where_it_outlasts_the_hop_compute() -> None:
    layout = Layout(seq_len=131072, dims=ParallelDims(cp=16, dp=1))
    nvlink_like = Machine.from_gpu(
        GPUS["H100"], network="infiniband-ndr", gpus_per_node=16, nvlink_domain=16
    )
    hidden = predict(LLAMA_8B, layout, nvlink_like)
    assert hidden.detail["ring_hop_transfer_seconds"] < hidden.detail["ring_hop_compute_seconds"]
    assert hidden.terms["cp_ring_exposed"] == 0
    slow = Machine.from_gpu(GPUS["H100"], network="tcp", gpus_per_node=1)
    exposed = predict(LLAMA_8B, layout, slow)
    d = exposed.detail
    assert d["ring_hop_transfer_seconds"] > d["ring_hop_compute_seconds"]
    # forward: (transfer - compute) per hop, 15 hops, 32 layers; backward adds its own excess
    assert exposed.terms["cp_ring_exposed"] > 32 * 15 * (
        d["ring_hop_transfer_seconds"] - d["ring_hop_compute_seconds"]
    )


def test_allgather_cp_exposes_its_gather_and_runs_one_long_attention_call() -> None:
    # Llama 3's CP: K/V of the other 15 ranks gathered per layer (bf16), fp32 dK/dV
    # reduce-scattered, 15 ring steps each over the network (cp 16 spans two nodes), exposed.
    layout = Layout(seq_len=131072, dims=ParallelDims(cp=16, dp=1))
    ring = predict(LLAMA_8B, layout, H100_NDR)
    gathered = predict(LLAMA_8B, layout.with_dims(cp_algorithm="allgather"), H100_NDR)
    assert gathered.terms["cp_ring_exposed"] == 0 == ring.terms["cp_allgather"]
    kv_others = 15 * (131072 / 16) * LLAMA_8B.kv_hidden
    link = H100_NDR.network
    expected = 32 * (
        2 * kv_others * 2 / H100_NDR.bandwidth(link)
        + 15 * link.latency_seconds
        + 2 * kv_others * 4 / H100_NDR.bandwidth(link)
        + 15 * link.latency_seconds
    )
    assert gathered.terms["cp_allgather"] == pytest.approx(expected)
    # One call over the whole sequence's keys: the length ramp of 131K tokens, not of 8K, so
    # the same score entries take less time than the ring's sixteen block calls.
    assert gathered.terms["compute_attention"] < ring.terms["compute_attention"]
    assert gathered.terms["compute_matmul"] == ring.terms["compute_matmul"]
    # What a rank receives per block (the same K/V elements as the ring's 15 forward hops), and
    # the planner holds the whole sequence's K/V and fp32 dK/dV while a layer's attention runs.
    from ctxlaunch.perf import activations, commvolume

    all_gather = layout.with_dims(cp_algorithm="allgather")
    assert commvolume.cp_block_bytes(LLAMA_8B, all_gather) == pytest.approx(
        2 * kv_others * 2 + 2 * kv_others * 4
    )
    assert commvolume.cp_block_bytes(LLAMA_8B, all_gather) < commvolume.cp_block_bytes(
        LLAMA_8B, layout
    )
    kv, a = LLAMA_8B.kv_hidden, 2
    assert (
        activations.attention_workspace_bytes_per_token(LLAMA_8B, all_gather)
        - activations.attention_workspace_bytes_per_token(LLAMA_8B, layout)
    ) == pytest.approx(16 * (2 * a * kv + 2 * 4 * kv) - (2 * 2 * 4 * kv + 2 * 2 * a * kv))


def test_ulysses_all_to_all_and_tp_collectives_appear_with_their_degree() -> None:
    ring = predict(LLAMA_8B, Layout(seq_len=32768, dims=ParallelDims(cp=8, tp=1)), H100_NDR)
    ulysses = predict(
        LLAMA_8B,
        Layout(seq_len=32768, dims=ParallelDims(cp=8, cp_algorithm="ulysses", ulysses_degree=8)),
        H100_NDR,
    )
    assert ring.terms["ulysses_all_to_all"] == 0 < ulysses.terms["ulysses_all_to_all"]
    tp = predict(LLAMA_8B, Layout(seq_len=32768, dims=ParallelDims(tp=8)), H100_NDR)
    assert tp.terms["tp_collectives"] > 0 and ring.terms["tp_collectives"] == 0


def test_pipeline_bubble_follows_the_schedule() -> None:
    base = Layout(seq_len=8192, grad_accum=8, dims=ParallelDims(pp=4, dp=2))
    one_f_one_b = predict(LLAMA_8B, base, H100_NDR)
    micro = one_f_one_b.detail["microbatch_seconds"]
    assert one_f_one_b.terms["pp_bubble"] == pytest.approx(3 * micro)
    interleaved = predict(LLAMA_8B, base.with_dims(virtual_stages=2), H100_NDR)
    assert interleaved.terms["pp_bubble"] == pytest.approx(1.5 * micro)


def test_full_recomputation_costs_a_forward() -> None:
    layout = Layout(seq_len=8192, dims=ParallelDims(dp=8))
    none = predict(LLAMA_8B, layout, H100_NDR)
    full = predict(LLAMA_8B, layout.replace(activation_checkpointing="full"), H100_NDR)
    ratio = full.terms["compute_attention"] / none.terms["compute_attention"]
    assert ratio == pytest.approx(16 / 12)
    assert 1.25 < full.terms["compute_matmul"] / none.terms["compute_matmul"] < 1.34


@pytest.mark.parametrize(
    "name", ["demo.yaml", "llama3-8b-128k-slurm.yaml", "llama3-70b-1m-k8s.yaml"]
)
def test_every_runnable_example_gets_a_prediction(name: str) -> None:
    st = predict_spec(load_spec(JOBS / name))
    assert st.step_seconds > 0 and 0 < st.mfu["causal"] < 1


def test_cpu_overheads_are_counted_where_measured_and_absent_on_gpus() -> None:
    layout = Layout(seq_len=4096, dims=ParallelDims(cp=4, dp=1))
    gpu = predict(LLAMA_8B, layout, H100_NDR)
    # On GPUs: no per-sync cost; the fixed cost per micro-batch is the profile's measured one.
    assert gpu.terms["sync_overhead"] == 0
    assert (
        gpu.terms["framework_overhead"] == profiles.profile("ctxlaunch").microbatch_overhead_seconds
    )
    import dataclasses

    cpu_like = dataclasses.replace(
        H100_NDR, causal_tile_tokens=512, sync_seconds=1e-3, microbatch_overhead_seconds=0.01
    )
    cpu = predict(LLAMA_8B, layout, cpu_like)
    assert cpu.terms["compute_attention"] == pytest.approx(
        gpu.terms["compute_attention"] * (1 + 512 / 4096)
    )
    assert cpu.terms["framework_overhead"] == pytest.approx(0.01)
    # 3 ring hops forward and 3 backward per layer, plus the step's gradient all-reduce
    assert cpu.terms["sync_overhead"] == pytest.approx(1e-3 * (32 * 6 + 1))


def test_a_gemm_loses_its_last_wave_and_small_ones_are_memory_bound() -> None:
    from ctxlaunch.perf.profiles import GEMM_TILE, gemm_seconds

    rate = {"peak": 1e15, "eta": 1.0, "hbm_bytes_per_second": 4e13, "element_bytes": 2}
    tm, tn = GEMM_TILE
    # 132 tiles fill 132 SMs in one wave; one tile more needs a second, half-empty wave.
    full = gemm_seconds(tm * 132, tn, 8192, sm_count=132, **rate)
    assert full == pytest.approx(2 * tm * 132 * tn * 8192 / 1e15)
    over = gemm_seconds(tm * 133, tn, 8192, sm_count=132, **rate)
    assert over == pytest.approx(2 * tm * 133 * tn * 8192 / 1e15 * (2 * 132 / 133))
    # A skinny GEMM (16 rows) reads its weight: memory time, not FLOP time.
    slow = {**rate, "hbm_bytes_per_second": 4e12}
    skinny = gemm_seconds(16, 4096, 4096, sm_count=132, **slow)
    assert skinny == pytest.approx(2 * (16 * 4096 + 4096 * 4096 + 16 * 4096) / 4e12)
    assert gemm_seconds(16, 4096, 4096, sm_count=0, **slow) < skinny  # the CPU: neither


def test_attention_by_length_head_dim_and_kernel_generation() -> None:
    from ctxlaunch.perf.profiles import attention_seconds

    kw = {
        "peak": 1e15,
        "fraction": 0.3,
        "ramp_tokens": 1000.0,
        "sfu_ops_per_second": 4e12,
        "matmul_flops_per_entry": 12,
    }
    entries = 1e12
    hidden = attention_seconds(entries, 128, 64000, exp_exposed=False, **kw)
    assert hidden == pytest.approx(entries * 12 * 128 / (0.3e15 * 64000 / 65000))
    short = attention_seconds(entries, 128, 2000, exp_exposed=False, **kw)
    assert short / hidden == pytest.approx((2000 + 1000) / 2000 * 64000 / 65000)
    exposed = attention_seconds(entries, 128, 64000, exp_exposed=True, **kw)
    assert exposed - hidden == pytest.approx(entries * 2 / 4e12)
    # At head dim 64 the exponentials weigh twice as much against the matmuls.
    d64 = attention_seconds(entries, 64, 64000, exp_exposed=True, **kw)
    assert (d64 - hidden / 2) / d64 > (exposed - hidden) / exposed


GPU_RUN = ROOT / "benchmarks" / "results" / "gpu_steptime-2026-12-04-run2.json"


def test_the_bundled_profile_is_its_h200_calibration_and_predicts_the_held_out_layouts() -> None:
    """The bundled profile's constants are the H200 calibration of benchmarks/gpu_steptime.py's
    second run (BENCHMARKS.md, step-time model: GPU calibration and held-out trainer layouts),
    and with them `predict` times the seven trainer layouts that calibration never ran within
    the profile's stated error of what the trainer measured there (the median of its timed
    steps)."""
    run = json.loads(GPU_RUN.read_text())
    calibration = GpuCalibration(**run["calibration"])
    bundled = profiles.profile("ctxlaunch")
    assert bundled.eta_matmul["bf16"] == pytest.approx(calibration.eta_matmul, abs=5e-4)
    assert bundled.attention_fraction == pytest.approx(calibration.attention_fraction, abs=5e-4)
    assert bundled.attention_ramp_tokens == pytest.approx(
        calibration.attention_ramp_tokens, abs=1.0
    )
    assert bundled.elementwise_fraction_of_hbm == pytest.approx(
        calibration.elementwise_fraction_of_hbm, abs=5e-4
    )
    assert bundled.loss_fraction_of_hbm == pytest.approx(calibration.loss_fraction_of_hbm, abs=5e-4)
    assert bundled.microbatch_overhead_seconds == pytest.approx(
        calibration.microbatch_overhead_seconds, abs=1e-4
    )
    model = ModelSpec(preset="llama3.2-1b")
    h200 = Machine.from_gpu(GPUS["H200"], network="infiniband-ndr", gpus_per_node=1)
    assert h200.framework == "ctxlaunch" and not h200.overlap_dp
    errors = []
    for point in run["points"]:
        layout = Layout(
            seq_len=point["seq_len"],
            micro_batch=point["micro_batch"],
            activation_checkpointing=point["checkpointing"],
        )
        predicted = predict(model, layout, h200).step_seconds
        errors.append(predicted / statistics.median(point["measured_steps"]) - 1)
    assert len(errors) == 7
    assert max(abs(e) for e in errors) <= bundled.expected_error, errors
    fit = predict(model, Layout(seq_len=16384, activation_checkpointing="selective"), h200)
    megatron = Machine.from_gpu(
        GPUS["H200"], network="infiniband-ndr", gpus_per_node=1, framework="megatron"
    )
    # Megatron's fused kernels run the same elementwise bytes at the full bandwidth.
    fused = predict(model, Layout(seq_len=16384, activation_checkpointing="selective"), megatron)
    assert fused.terms["compute_elementwise"] < fit.terms["compute_elementwise"] / 3
    with pytest.raises(ValueError, match="framework 'nope': not a known profile"):
        Machine.from_gpu(GPUS["H200"], network="infiniband-ndr", gpus_per_node=1, framework="nope")


def test_the_loss_passes_over_the_logits_the_rank_holds_at_the_loss_rate() -> None:
    """52 bytes per logit in bf16 (40 in fp32: no upcast, no cast back), over the tokens the
    rank holds and the vocabulary rows it holds (TP shards them), at the profile's loss rate;
    a 1B model's 128K-vocabulary loss weighs as much as a quarter of its blocks' elementwise
    work at the bundled rates."""
    from ctxlaunch.perf.steptime import LOSS_BYTES_PER_LOGIT

    model = ModelSpec(preset="llama3.2-1b")
    h200 = Machine.from_gpu(GPUS["H200"], network="infiniband-ndr", gpus_per_node=8)
    rate = profiles.profile("ctxlaunch").loss_fraction_of_hbm * GPUS["H200"].hbm_bytes_per_second
    assert h200.loss_bytes_per_second == pytest.approx(rate)
    one = predict(model, Layout(seq_len=8192), h200).terms
    assert one["compute_loss"] == pytest.approx(8192 * 128256 * 52 / rate)
    assert LOSS_BYTES_PER_LOGIT == {2: 52.0, 4: 40.0}
    fp32 = predict(
        model.model_copy(update={"dtype": "fp32"}),
        Layout(seq_len=8192, dtype="fp32", matmul_precision="fp32"),
        h200,
    ).terms
    assert fp32["compute_loss"] == pytest.approx(one["compute_loss"] * 40 / 52)
    sharded = predict(model, Layout(seq_len=8192, dims=ParallelDims(tp=2, cp=2)), h200).terms
    assert sharded["compute_loss"] == pytest.approx(one["compute_loss"] / 4)
    assert one["compute_loss"] > one["compute_elementwise"] / 4
    # A profile with no loss rate of its own (a CPU calibration) runs it at the elementwise rate.
    import dataclasses

    shared = dataclasses.replace(h200, loss_bytes_per_second=None)
    assert predict(model, Layout(seq_len=8192), shared).terms["compute_loss"] == pytest.approx(
        8192 * 128256 * 52 / h200.elementwise_bytes_per_second
    )
