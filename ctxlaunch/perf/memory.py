"""The per-GPU memory model: will this job fit, and with which CP degree.

Pure arithmetic over the slice of the spec it reads (`Layout`); no torch. The estimate adds up
the parts the modules beside this one model, each documented there:
- ctxlaunch.perf.activations: what a rank saves for backward per token and per pipeline stage
  (the per-token table of a block, checkpointing, TP and PP), and the transients of one
  attention call and of the chunked loss;
- ctxlaunch.perf.modelstates: the parameters a rank holds and their weights, gradients and
  optimizer states by engine (plain torch, DeepSpeed ZeRO, FSDP2), with the engines'
  communication buffers;
- ctxlaunch.perf.peakphases: what is live at the highest moment of each phase of a
  steady-state step, stage by stage (`peak_phases`). `estimate` never plans below that peak.

What the model does not know precisely is an allowance, stated: on a GPU 1.5 GiB (CUDA context,
cuBLAS workspaces, NCCL channels) plus 5 % of everything else for allocator fragmentation, plus
`cuda_kernel_allowance` (FlashAttention's fp32 dQ accumulator and the caching allocator's
segments); on the CPU 0.4 GiB (the Python and torch runtime) plus 5 %.

The names the trainer, the planner and the tests read from those modules are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxlaunch.contract.hardware import GiB, GpuInfo
from ctxlaunch.perf.activations import (
    BACKWARD_CHUNK_TOKENS,
    LOSS_CHUNK_TOKENS,
    activation_bytes,
    attention_workspace_bytes_per_token,
    autocast_weight_copy_bytes,
    block_activation_bytes_per_token,
    loss_workspace_bytes,
    recompute_bytes_per_token,
    stage_activation_bytes,
)
from ctxlaunch.perf.hostmemory import HostLimit, host_estimate
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.modelstates import (
    GRAD_BUCKET_ELEMENTS,
    ZERO3_PREFETCH_ELEMENTS,
    ZERO_BUCKET_ELEMENTS,
    busiest_rank_states,
    communication_buffer_bytes,
    deepspeed_bucket_bytes,
    largest_layer_params,
    model_state_bytes,
    params_per_rank,
    pipeline_accumulated_grad_bytes,
)
from ctxlaunch.perf.peakphases import Phase, peak, peak_phases, pipeline_recv_buffers

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec

__all__ = [
    "BACKWARD_CHUNK_TOKENS",
    "CPU_FIXED_ALLOWANCE",
    "FRAGMENTATION",
    "GPU_FIXED_ALLOWANCE",
    "GRAD_BUCKET_ELEMENTS",
    "LOSS_CHUNK_TOKENS",
    "ZERO3_PREFETCH_ELEMENTS",
    "ZERO_BUCKET_ELEMENTS",
    "MemoryEstimate",
    "Phase",
    "activation_bytes",
    "autocast_weight_copy_bytes",
    "block_activation_bytes_per_token",
    "cuda_kernel_allowance",
    "estimate",
    "fits_with_host",
    "largest_layer_params",
    "longest_sequence",
    "model_state_bytes",
    "params_per_rank",
    "peak",
    "peak_phases",
    "pipeline_recv_buffers",
    "sequence_granularity",
    "stage_activation_bytes",
]

GPU_FIXED_ALLOWANCE = int(1.5 * GiB)
CPU_FIXED_ALLOWANCE = int(0.4 * GiB)
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of one rank, by part, in bytes."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    """Saved for backward at the peak (the start of backward)."""
    workspace: int
    """The largest transient on top: the chunked loss, or one block's attention buffers and
    recomputation in backward."""
    communication_buffers: int
    """Gradient all-reduce / ZeRO buckets."""
    allowance: int
    capacity: int

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.workspace
            + self.communication_buffers
            + self.allowance
        )

    @property
    def headroom(self) -> int:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def parts(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_states", self.optimizer_states),
            ("activations", self.activations),
            ("workspace", self.workspace),
            ("communication_buffers", self.communication_buffers),
            ("allowance", self.allowance),
        ]

    def to_dict(self) -> dict[str, int | bool]:
        out: dict[str, int | bool] = {f"{name}_bytes": value for name, value in self.parts()}
        out.update(
            total_bytes=self.total,
            capacity_bytes=self.capacity,
            headroom_bytes=self.headroom,
            fits=self.fits,
        )
        return out


def cuda_kernel_allowance(model: ModelSpec, layout: Layout) -> float:
    """What a CUDA GPU allocates that the CPU measurement (tests/unit/test_memory_peak.py) does not
    show, per rank, beyond GPU_FIXED_ALLOWANCE (context, cuBLAS workspaces, NCCL) and
    FRAGMENTATION (see the module docstring): FlashAttention-2's backward keeps an fp32 dQ
    accumulator (B x S x H x D, `dq_accum` in flash_bwd_launch_template.h) and the fp32
    softmax-d buffer (B x H x S) next to dq, dk, dv, none of which the CPU flash kernel
    allocates at full size; the caching allocator rounds every block up to 512 B and carves
    small blocks (<= 1 MiB) out of 2 MiB segments and large ones out of 20 MiB segments
    (c10/cuda/CUDACachingAllocator.cpp, kRoundSmall/kSmallBuffer/kLargeBuffer): one 2 MiB
    small segment and one 20 MiB large segment half-empty at the peak are allowed for."""
    # Under Ulysses the kernel sees the whole sequence and heads / N: the same bytes. Under
    # attention tiles each of the ring's kernel calls covers one tile's query rows.
    flash = (
        layout.tokens_per_rank
        * (4 * model.q_hidden + 4 * model.heads)
        * layout.attention_tile_fraction
        / layout.dims.tp
    )
    return flash + 2 * 2**20 + 20 * 2**20


def estimate(model: ModelSpec, layout: Layout, gpu: GpuInfo) -> MemoryEstimate:
    """Predicted peak memory of the busiest rank."""
    parameters, gradients, optimizer = busiest_rank_states(model, layout)
    gradients += pipeline_accumulated_grad_bytes(
        layout,
        params_per_rank(model, layout.dims.tp, layout.dims.pp, layout.rank_layers(model.layers)),
    )
    activations = activation_bytes(model, layout)
    sequence_parallel_tokens = layout.tokens_per_rank / layout.dims.tp
    workspace = max(
        loss_workspace_bytes(model, layout),
        sequence_parallel_tokens
        * (
            attention_workspace_bytes_per_token(model, layout)
            + recompute_bytes_per_token(model, layout)
            # gradients flowing between blocks: d(out) and d(in) of the block
            + 2 * layout.residual_bytes * model.hidden
        ),
    )
    # The phase-by-phase peak: never plan below what is live at the highest moment of a
    # steady-state step of the bundled trainer, whatever the sum of the parts above says.
    comm = communication_buffer_bytes(layout)
    if layout.framework == "ctxlaunch":
        workspace = max(
            workspace,
            peak(model, layout).total
            - (parameters + gradients + optimizer + activations + deepspeed_bucket_bytes(layout)),
        )
    known = parameters + gradients + optimizer + activations + workspace + comm
    fixed = (
        CPU_FIXED_ALLOWANCE
        if gpu.name == "cpu"
        else GPU_FIXED_ALLOWANCE + cuda_kernel_allowance(model, layout)
    )
    return MemoryEstimate(
        parameters=int(parameters),
        gradients=int(gradients),
        optimizer_states=int(optimizer),
        activations=int(activations),
        workspace=int(workspace),
        communication_buffers=int(comm),
        allowance=int(fixed + FRAGMENTATION * known),
        capacity=gpu.memory_bytes,
    )


def sequence_granularity(cp: int, cp_sharding: str = "zigzag") -> int:
    """Sequence lengths the planner tries are multiples of this (legal for the CP layout)."""
    unit = 2 * cp if cp_sharding == "zigzag" else cp
    return max(unit, 1024) if 1024 % unit == 0 else unit


def fits_with_host(
    model: ModelSpec, layout: Layout, gpu: GpuInfo, host: HostLimit | None = None
) -> bool:
    """Whether the layout fits its GPU and, when it offloads and `host` is given, its node's
    host memory (ctxlaunch.perf.hostmemory)."""
    device = estimate(model, layout, gpu)
    if not device.fits:
        return False
    if host is None or not layout.offloads:
        return True
    return host_estimate(model, layout, host, device.total).fits


def longest_sequence(
    model: ModelSpec,
    layout: Layout,
    gpu: GpuInfo,
    cp_sharding: str = "zigzag",
    limit: int = 1 << 24,
    host: HostLimit | None = None,
) -> int:
    """The longest sequence (a multiple of `sequence_granularity`) that fits at the layout's
    CP degree (and, offloading, in `host`'s memory); 0 when not even the shortest fits."""
    unit = sequence_granularity(layout.dims.cp, cp_sharding)

    def fits(units: int) -> bool:
        return fits_with_host(model, layout.replace(seq_len=units * unit), gpu, host)

    fitting, too_long = 0, limit // unit  # in units; bisection bounds
    if fits(too_long):
        return too_long * unit
    while too_long - fitting > 1:  # invariant: `fitting` fits (or is 0), `too_long` does not
        middle = (fitting + too_long) // 2
        if fits(middle):
            fitting = middle
        else:
            too_long = middle
    return fitting * unit
