"""The planner's offload terms: host memory by hand, the device states each switch leaves, the
copies over the host link in the step time, the tiled feed-forward's extra forward, the spec
rules, and the longest sequence `plan` reports for Llama-3.1-8B on H100 with offload."""

from __future__ import annotations

import pytest

from ctxlaunch.contract.hardware import GPUS, LINKS, GiB
from ctxlaunch.contract.loader import validate_spec
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.hostmemory import (
    HOST_RANK_ALLOWANCE,
    HOST_SYSTEM_SHARE,
    HostLimit,
    host_estimate,
)
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.machine import Machine
from ctxlaunch.perf.memory import estimate, largest_layer_params, longest_sequence
from ctxlaunch.perf.modelstates import params_per_rank
from ctxlaunch.perf.steptime import predict
from ctxlaunch.planning.plan import plan_job
from tests.helpers.specs import make, problems

LLAMA_8B = ModelSpec(preset="llama3-8b")
H100 = GPUS["H100"]
DGX = HostLimit(host_memory_bytes=2000 * 1000**3, gpus_per_node=8)


def _layout(**changes) -> Layout:
    """Llama 3 8B at 128K tokens, CP 8, ZeRO-3 under DeepSpeed, full checkpointing, bf16."""
    base = Layout(
        seq_len=131072,
        micro_batch=1,
        grad_accum=1,
        zero_stage=3,
        engine="deepspeed",
        activation_checkpointing="full",
        dtype="bf16",
        matmul_precision="bf16",
        dims=ParallelDims(tp=1, pp=1, cp=8, dp=1, cp_algorithm="ring"),
    )
    degrees = {k: changes.pop(k) for k in list(changes) if k in ("tp", "pp", "cp", "dp")}
    return base.with_dims(**degrees).replace(**changes)


def test_deepspeed_host_memory_by_hand() -> None:
    """ZeRO-3 with the optimizer and parameters offloaded: 16 + 2 bytes per parameter of the
    rank's partition (fp32 master with its gradient, Adam's moments, the flat 16-bit gradient)
    and 2 for the parameter partition; activations: every block's input but the last's."""
    layout = _layout(offload_optimizer=True, offload_parameters=True, offload_activations=True)
    shard = params_per_rank(LLAMA_8B, 1, 1, layout.rank_layers(LLAMA_8B.layers)) / 8
    host = host_estimate(LLAMA_8B, layout, DGX)
    assert host.optimizer == int(18 * shard)
    assert host.parameters == int(2 * shard)
    assert host.activations == 31 * (131072 // 8) * 4096 * 2
    assert host.allowance == HOST_RANK_ALLOWANCE
    assert host.ranks_per_node == 8
    assert host.per_node == 8 * (
        host.optimizer + host.parameters + host.activations + HOST_RANK_ALLOWANCE
    )
    assert host.capacity == int(2000 * 1000**3 * (1 - HOST_SYSTEM_SHARE))
    assert host.fits


def test_fsdp2_host_memory_by_hand() -> None:
    """FSDP2's CPU offload policy: fp32 shards, their gradients, AdamW's moments and its
    step's fp32 temporary, 20 bytes per parameter of the shard; no parameter term."""
    layout = _layout(engine="fsdp2", tp=2, cp=4, offload_optimizer=True)
    shard = params_per_rank(LLAMA_8B, 2, 1, layout.rank_layers(LLAMA_8B.layers)) / 4
    host = host_estimate(LLAMA_8B, layout, DGX)
    assert host.optimizer == int(20 * shard)
    assert host.parameters == 0 and host.activations == 0


def test_nothing_offloaded_puts_nothing_on_the_host() -> None:
    host = host_estimate(LLAMA_8B, _layout(), DGX)
    assert host.offloaded_per_rank == 0


def test_device_states_leave_with_each_switch() -> None:
    """ZeRO-3 offloading the optimizer keeps the 16-bit partition and the gathered largest
    layer; the parameters too, the gathered layer alone; nothing of the optimizer or the
    gradients stays."""
    plain = estimate(LLAMA_8B, _layout(), H100)
    optimizer = estimate(LLAMA_8B, _layout(offload_optimizer=True), H100)
    both = estimate(LLAMA_8B, _layout(offload_optimizer=True, offload_parameters=True), H100)
    params = params_per_rank(LLAMA_8B, 1, 1, [LLAMA_8B.layers])
    gathered = 4 * largest_layer_params(LLAMA_8B, 1)
    assert optimizer.optimizer_states == 0 and optimizer.gradients == 0
    assert optimizer.parameters == 2 * params // 8 + gathered
    assert both.parameters == gathered
    assert plain.total > optimizer.total > both.total


def test_offloaded_activations_and_tiles_lengthen_the_reach() -> None:
    reach = {
        name: longest_sequence(LLAMA_8B, _layout(**changes), H100, host=DGX)
        for name, changes in {
            "plain": {},
            "optimizer": {"offload_optimizer": True, "offload_parameters": True},
            "activations": {
                "offload_optimizer": True,
                "offload_parameters": True,
                "offload_activations": True,
            },
            "tiled": {
                "offload_optimizer": True,
                "offload_parameters": True,
                "offload_activations": True,
                "mlp_tile_tokens": 4096,
            },
        }.items()
    }
    assert reach["plain"] < reach["optimizer"] < reach["activations"] < reach["tiled"]


def test_attention_tiles_lengthen_the_ring_reach() -> None:
    """On a ring the kernels' gradient buffers grow with the shard; tiles bound them (in the
    sum of the parts, the CUDA allowance and the phase peak), and nothing changes without a
    ring."""
    from ctxlaunch.perf.memory import cuda_kernel_allowance, estimate, peak

    recipe = {
        "offload_optimizer": True,
        "offload_parameters": True,
        "offload_activations": True,
        "mlp_tile_tokens": 4096,
        "cp": 32,
        "seq_len": 15_000_000,
    }
    whole = _layout(**recipe)
    tiled = whole.replace(attention_tile_tokens=65536)
    assert 0 < tiled.attention_tile_fraction < 0.15 and whole.attention_tile_fraction == 1
    assert estimate(LLAMA_8B, tiled, H100).total < estimate(LLAMA_8B, whole, H100).total
    assert not estimate(LLAMA_8B, whole, H100).fits and estimate(LLAMA_8B, tiled, H100).fits
    assert cuda_kernel_allowance(LLAMA_8B, tiled) < cuda_kernel_allowance(LLAMA_8B, whole)
    assert peak(LLAMA_8B, tiled).total < peak(LLAMA_8B, whole).total
    ulysses = whole.with_dims(cp=8, cp_algorithm="ulysses", ulysses_degree=8).replace(
        seq_len=1 << 20
    )
    assert ulysses.replace(attention_tile_tokens=65536).attention_tile_fraction == 1
    assert "training.attention_tile_tokens" in problems(
        make(**{"training.attention_tile_tokens": 4096, "parallel.cp": 1})
    )


def test_host_memory_bounds_the_reach() -> None:
    """With too little host memory the offloaded activations stop the sequence short."""
    layout = _layout(offload_optimizer=True, offload_activations=True)
    roomy = longest_sequence(LLAMA_8B, layout, H100, host=DGX)
    small = HostLimit(host_memory_bytes=600 * GiB, gpus_per_node=8)
    short = longest_sequence(LLAMA_8B, layout, H100, host=small)
    assert 0 < short < roomy
    assert host_estimate(LLAMA_8B, layout.replace(seq_len=short), small).fits
    assert not host_estimate(LLAMA_8B, layout.replace(seq_len=roomy), small).fits


def _h100_machine() -> Machine:
    return Machine.from_gpu(H100, network="infiniband-ndr", gpus_per_node=8)


def test_activation_copies_over_pcie_by_hand() -> None:
    """Each micro-batch every offloaded block input crosses PCIe Gen5 out and back; the copies
    run beside the compute, so what is exposed is at most that."""
    machine = _h100_machine()
    assert machine.host_link is LINKS["pcie5"]
    layout = _layout(offload_activations=True)
    got = predict(LLAMA_8B, layout, machine)
    plain = predict(LLAMA_8B, _layout(), machine)
    copied = 2 * 31 * (131072 // 8) * 4096 * 2
    assert got.detail["host_copy_seconds"] == pytest.approx(copied / (machine.eta_comm * 64e9))
    assert 0 <= got.terms["host_copies_exposed"] <= got.detail["host_copy_seconds"]
    assert plain.terms["host_copies_exposed"] == 0


def test_a_copy_longer_than_the_compute_is_exposed() -> None:
    """At a short sequence the compute cannot hide the parameter fetches."""
    machine = _h100_machine()
    short = _layout(seq_len=4096, offload_optimizer=True, offload_parameters=True)
    got = predict(LLAMA_8B, short, machine)
    assert got.terms["host_copies_exposed"] > 0


def test_offloaded_optimizer_steps_at_the_host_memory_bandwidth() -> None:
    machine = _h100_machine()
    on_device = predict(LLAMA_8B, _layout(), machine).terms["optimizer"]
    on_host = predict(LLAMA_8B, _layout(offload_optimizer=True), machine).terms["optimizer"]
    shard = params_per_rank(LLAMA_8B, 1, 1) / 8
    assert on_host == pytest.approx(shard * 32 / (H100.node_host_bytes_per_second / 8))
    assert on_host > on_device


def test_tiled_feed_forward_adds_one_forward_of_its_projections() -> None:
    machine = _h100_machine()
    plain = predict(LLAMA_8B, _layout(), machine)
    tiled = predict(LLAMA_8B, _layout(mlp_tile_tokens=4096), machine)
    extra = tiled.terms["compute_matmul"] - plain.terms["compute_matmul"]
    assert extra > 0
    # The feed-forward's three projections are the larger part of a block's weights.
    assert extra < plain.terms["compute_matmul"] / 4
    assert tiled.terms["compute_elementwise"] == plain.terms["compute_elementwise"]


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"training.offload.optimizer": "true"}, "training.offload.optimizer", "zero_stage"),
        (
            {"training.offload.parameters": "true", "training.zero_stage": 2},
            "training.offload.parameters",
            "zero_stage 3",
        ),
        (
            {"training.offload.activations": "true"},
            "training.offload.activations",
            "activation_checkpointing: full",
        ),
    ],
)
def test_each_switch_names_what_it_needs(changes: dict, field: str, words: str) -> None:
    assert words in problems(make(**changes))[field]


def test_host_memory_gib_is_a_positive_number() -> None:
    assert "cluster.host_memory_gib" in problems(make(**{"cluster.host_memory_gib": -1}))


def _reach_spec(gpus: int, host_gib: float | None = None) -> dict:
    data = make(
        **{
            "training.zero_stage": 3,
            "training.activation_checkpointing": "full",
            "training.global_batch": 1,
            "parallel.cp": gpus,
            "cluster.nodes": max(1, gpus // 8),
            "cluster.gpus_per_node": min(gpus, 8),
        }
    )
    if host_gib is not None:
        data["cluster"]["host_memory_gib"] = host_gib
    return data


@pytest.mark.parametrize("gpus, anchor", [(1, 500_000), (8, 3_700_000), (32, 15_000_000)])
def test_reach_of_llama3_8b_on_h100_with_offload(gpus: int, anchor: int) -> None:
    """Arctic Long Sequence Training's reach for Llama-3.1-8B on H100 (500K tokens on 1 GPU,
    3.7M on 8, 15M on 32), with the host memory its nodes had (1.9 TB): `plan`'s longest
    sequence with the offload recipe at least matches it."""
    report = plan_job(validate_spec(_reach_spec(gpus, host_gib=1900 * 1000**3 / GiB)))
    option = next(o for o in report.cp_options if o.dims.cp == gpus)
    assert option.longest_seq_len < anchor  # without offload it does not get there
    assert option.offload_seq_len >= anchor
    assert option.offload_host is not None and option.offload_host.fits


def test_plan_says_when_host_memory_is_what_does_not_fit() -> None:
    data = _reach_spec(8, host_gib=64)
    data["training"].update(
        engine="deepspeed",
        mlp_tile_tokens=4096,
        offload={"optimizer": True, "parameters": True, "activations": True},
    )
    data["training"]["seq_len"] = 1_048_576
    report = plan_job(validate_spec(data))
    assert report.estimate.fits and report.host is not None and not report.host.fits
    assert not report.fits
    assert "host memory" in report.verdict() and "cluster.host_memory_gib" in report.verdict()
    assert report.step_time is None


def test_advise_offloads_where_nothing_else_fits() -> None:
    """Llama 3 8B at 128K tokens on one H100 fits only with offload: advise ranks the mildest
    offload step that fits, says so in the layout, and the written spec carries it."""
    from ctxlaunch.planning.advise import advise

    spec = validate_spec(_reach_spec(1))
    advice = advise(spec)
    best = advice.best
    assert best is not None
    assert best.layout.offload_optimizer and "offload" in best.describe()
    assert best.time.terms["optimizer"] > 0
    changes = best.layout.overrides()
    assert changes["training.offload.optimizer"] is True
    assert validate_spec(best.layout.apply_to(spec).model_dump(mode="json")).training.offload.any


def test_plan_suggests_the_mildest_offload_step() -> None:
    report = plan_job(validate_spec(_reach_spec(1)))
    assert not report.fits
    suggestion = report.suggestions[0]
    assert suggestion.changes["training.offload.optimizer"] is True
    assert "training.offload.parameters" not in suggestion.changes  # not needed at 128K
    assert suggestion.host is not None and "GiB host memory per node" in report.verdict()
