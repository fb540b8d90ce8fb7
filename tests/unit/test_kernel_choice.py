"""The attention kernel chosen by measurement (ctxlaunch.cp.kernel_choice), on the CPU.

The CPU has one attention kernel, so a run there reports it as the only one. The measuring
itself (every candidate run, checked against the first and timed, the ones this torch cannot
run refused with the reason, the fastest made the one ctxlaunch.cp.kernels calls) runs here
with `measure_on_cpu`, where every candidate executes the same CPU kernel; FlashAttention-3
cannot be activated without its package and a Hopper GPU, so it is refused, as on a GPU
without it. What each kernel costs on a GPU is only measured there (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import pytest
import torch

from ctxlaunch.contract.loader import apply_overrides, validate_spec
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.cp import kernel_choice, kernels
from ctxlaunch.runtime.trainer import fastpath

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def restore_kernel(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(kernel_choice.ENV, raising=False)
    yield
    kernels.use_cuda_kernel("flash")


def test_the_cpu_has_one_kernel() -> None:
    choice = kernel_choice.choose(1, 4, 2, 64, 16, torch.float32, CPU)
    assert (choice.kernel, choice.chosen_by) == ("cpu flash", "only")
    assert choice.describe() == "cpu flash (only)"


def test_measuring_times_each_kernel_that_runs_and_refuses_the_rest() -> None:
    choice = kernel_choice.choose(
        1, 4, 2, 64, 16, torch.bfloat16, CPU, repeats=3, measure_on_cpu=True
    )
    assert choice.chosen_by == "measured"
    assert choice.shape == (1, 4, 2, 64, 16)
    assert set(choice.seconds) == {"flash", "cudnn"}
    assert all(s > 0 for s in choice.seconds.values())
    assert choice.kernel == min(choice.seconds, key=choice.seconds.__getitem__)
    # FlashAttention-3 needs flash_attn_interface on a Hopper GPU: refused, with torch's reason.
    assert set(choice.refused) == {"fa3"} and choice.refused["fa3"]
    # The chosen kernel is the one the attention calls now name, and FA3 was not left active.
    q = torch.zeros(1, 4, 64, 16, dtype=torch.bfloat16)
    assert kernels.cuda_kernel_name(q) == choice.kernel
    assert torch.nn.attention.current_flash_attention_impl() != "FA3"
    line = choice.describe()
    assert line.startswith(f"{choice.kernel} (fastest fwd+bwd at 1x4/2 heads x 64 x 16: ")
    assert "ms" in line and "fa3 not used: " in line


def test_a_kernel_that_disagrees_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate whose gradients differ from the first candidate's is never chosen, however
    fast: here cuDNN's dq is made wrong by a scale the check must catch."""
    backward = kernels.attention_backward

    def wrong_for_cudnn(*args, **kwargs):
        dq, dk, dv = backward(*args, **kwargs)
        return (dq * 1.5, dk, dv) if kernels._cuda_kernel == "cudnn" else (dq, dk, dv)

    monkeypatch.setattr(kernels, "attention_backward", wrong_for_cudnn)
    choice = kernel_choice.choose(
        1,
        2,
        2,
        32,
        16,
        torch.bfloat16,
        CPU,
        repeats=2,
        candidates=("flash", "cudnn"),
        measure_on_cpu=True,
    )
    assert choice.kernel == "flash" and set(choice.seconds) == {"flash"}
    assert choice.refused["cudnn"].startswith("dq differs from flash's by ")


def test_fp32_runs_the_memory_efficient_kernel_only() -> None:
    choice = kernel_choice.choose(1, 2, 2, 32, 16, torch.float32, CPU, measure_on_cpu=True)
    assert (choice.kernel, choice.chosen_by) == ("memory-efficient", "only")


def test_the_environment_forces_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_choice.ENV, "cudnn")
    choice = kernel_choice.choose(1, 2, 2, 32, 16, torch.bfloat16, CPU)
    assert (choice.kernel, choice.chosen_by) == ("cudnn", "forced")
    assert kernels.cuda_kernel_name(torch.zeros(1, 2, 32, 16, dtype=torch.bfloat16)) == "cudnn"
    assert choice.describe() == "cudnn (forced)"


def test_a_bad_kernel_name_says_which_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_choice.ENV, "fa4")
    with pytest.raises(ValueError, match="'fa4': expected one of flash, cudnn, fa3"):
        kernel_choice.choose(1, 2, 2, 32, 16, torch.bfloat16, CPU)


def _spec(*overrides: str):
    base = {
        "name": "shape",
        "model": {"preset": "tiny", "dtype": "bf16"},
        "training": {"seq_len": 4096, "micro_batch": 2, "global_batch": 2, "steps": 1},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }
    return validate_spec(apply_overrides(base, list(overrides)))


@pytest.mark.parametrize(
    ("cp", "ulysses", "tp", "cp_sharding", "expected_block"),
    [
        (1, 1, 1, "contiguous", 4096),
        (4, 1, 1, "zigzag", 512),  # a zigzag ring calls the kernel on half of each chunk
        (4, 1, 1, "contiguous", 1024),
        (4, 4, 1, "contiguous", 4096),  # Ulysses: the whole sequence, a quarter of the heads
        (4, 2, 2, "zigzag", 1024),  # hybrid: ring of 2 (half-chunks of 2048), heads / (2 x 2)
    ],
)
def test_the_block_shape_is_the_one_the_rank_calls(
    cp, ulysses, tp, cp_sharding, expected_block
) -> None:
    spec = _spec()
    dims = ParallelDims(
        cp=cp,
        ulysses_degree=ulysses,
        tp=tp,
        cp_sharding=cp_sharding,
        cp_algorithm="hybrid" if 1 < ulysses < cp else "ulysses" if ulysses > 1 else "ring",
    )
    batch, heads, kv_heads, block, head_dim = fastpath.attention_block_shape(spec, dims)
    m = spec.model
    assert (batch, block, head_dim) == (2, expected_block, m.hidden // m.heads)
    assert heads == max(m.heads // (tp * ulysses), 1)
    assert kv_heads == max(m.kv_heads // (tp * ulysses), 1)
