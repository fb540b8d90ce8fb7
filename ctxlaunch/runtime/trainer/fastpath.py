"""The trainer's fast paths on the device at hand: the switches (`training.compile`,
`training.fused_optimizer`; auto means on for CUDA, off on the CPU) and the attention kernel,
chosen by measurement at the run's block shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ctxlaunch.contract.parallel_dims import ParallelDims
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.cp.kernel_choice import KernelChoice
    from ctxlaunch.runtime.parallel.context import ParallelContext


def resolve(setting: bool | Literal["auto"], device: torch.device) -> bool:
    """A switch's value on `device`: as given, or for auto, whether the device is CUDA."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def attention_block_shape(spec: JobSpec, dims: ParallelDims) -> tuple[int, int, int, int, int]:
    """(batch, query heads, K/V heads, block length, head dim) of this rank's attention calls:
    the heads TP and Ulysses leave it, over the ring's block of the sequence (a zigzag ring
    calls the kernel on half-chunks)."""
    m = spec.model
    split = dims.tp * dims.ulysses_degree
    ring = dims.ring_degree
    block = spec.training.seq_len // ring
    if ring > 1 and dims.cp_sharding == "zigzag":
        block //= 2
    return (
        spec.training.micro_batch,
        max(m.heads // split, 1),
        max(m.kv_heads // split, 1),
        block,
        m.head_dim,
    )


def choose_attention_kernel(
    spec: JobSpec, ctx: ParallelContext, device: torch.device
) -> KernelChoice:
    """Measure the attention kernels at this rank's block shape (`ctxlaunch.cp.kernel_choice`)
    and use rank 0's choice on every rank, so that every rank runs the same kernel."""
    from ctxlaunch.cp import kernels
    from ctxlaunch.cp.kernel_choice import choose

    batch, heads, kv_heads, block, head_dim = attention_block_shape(spec, ctx.dims)
    dtype = torch.bfloat16 if spec.model.dtype == "bf16" else torch.float32
    choice = choose(batch, heads, kv_heads, block, head_dim, dtype, device)
    if device.type == "cuda" and dist.is_initialized() and dist.get_world_size() > 1:
        agreed = [choice]
        dist.broadcast_object_list(agreed, src=0)
        choice = agreed[0]
        if choice.kernel in kernels.CUDA_KERNELS:
            kernels.use_cuda_kernel(choice.kernel)
    return choice


def describe(spec: JobSpec, device: torch.device, attention: KernelChoice) -> str:
    """The run's first log line's account of the fast paths on `device`."""
    t = spec.training
    fused = resolve(t.fused_optimizer, device) and spec.state_engine != "deepspeed"
    return (
        f"attention {attention.describe()}, compile "
        f"{'on' if resolve(t.compile, device) else 'off'}, AdamW "
        f"{'fused' if fused else 'foreach'}"
    )
