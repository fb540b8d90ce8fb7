"""Host memory: what offloading (training.offload) puts in a node's CPU memory, and whether it
fits. Pure arithmetic over the layout, no torch; the device side is ctxlaunch.perf.memory's.

Per rank, by switch (Nd the sharding group DP x CP, P the parameters the rank holds before
sharding, r the residual stream's bytes, n the rank's tokens of a micro-batch, L its blocks):

- optimizer, DeepSpeed ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, cpu_offload): the
  fp32 master partition 4/Nd with its fp32 gradient 4/Nd, CPU Adam's two moments 8/Nd, the
  16-bit buffer the updated partition goes back through 2/Nd, with gradient accumulation the
  16-bit gradients accumulated per parameter 2/Nd, and a staging buffer of the largest
  parameter in 16 bits;
- optimizer, DeepSpeed ZeRO-3 (stage3.py): the fp32 partition with its gradient and the two
  moments 16/Nd and the flat 16-bit gradient partitions 2/Nd; with the parameters offloaded
  too, their 16-bit partitions 2/Nd;
- optimizer, FSDP2's CPU offload policy: the fp32 parameter shards 4/Nd, their gradients 4/Nd,
  AdamW's moments 8/Nd, and in the step foreach AdamW's fp32 denominator 4/Nd;
- activations (runtime/modeling/offload.py): one buffer per block but the last, each the
  block's input, (L - 1) x n x h x r, pinned on CUDA.

These were read off the tensors the engines keep in host memory after a step, and are checked
against them on the CPU (tests/unit/test_memory_peak.py). On top, per rank, the process's own
memory outside any tensor (CUDA context and libraries, the Python runtime, the data), an
allowance; per node, a share of its memory kept for the operating system and the page cache.
All of it must fit in the node's host memory (`cluster.host_memory_gib`, by default the usual
node of the GPU type: contract.hardware). On `gpu: cpu` the host is the device: its memory
holds both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxlaunch.contract.hardware import GiB
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.modelstates import params_per_rank

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec

HOST_RANK_ALLOWANCE = int(4 * GiB)
"""Host memory a GPU rank's process uses outside any tensor the planner counts: the CUDA
context and libraries (cuBLAS, cuDNN, NCCL), the Python and torch runtime, the data reader.
An allowance, not a measurement: such processes are typically a few GiB resident."""
HOST_SYSTEM_SHARE = 0.05
"""The share of a node's memory left to the operating system, the page cache and other
daemons: an allowance."""


@dataclass(frozen=True)
class HostEstimate:
    """Host memory of one rank and of the busiest node, in bytes, by what puts it there."""

    optimizer: int
    """Offloaded optimizer states, master weights and gradients (and their buffers)."""
    parameters: int
    """Offloaded ZeRO-3 parameter partitions."""
    activations: int
    """Offloaded block inputs (pinned buffers)."""
    allowance: int
    """The rank's process outside the counted tensors."""
    ranks_per_node: int
    capacity: int
    """The node's host memory, less the system's share (and on `gpu: cpu`, less what the
    ranks hold as device memory)."""

    @property
    def per_rank(self) -> int:
        return self.optimizer + self.parameters + self.activations + self.allowance

    @property
    def per_node(self) -> int:
        return self.per_rank * self.ranks_per_node

    @property
    def offloaded_per_rank(self) -> int:
        """What offloading moved to the host (no allowance)."""
        return self.optimizer + self.parameters + self.activations

    @property
    def fits(self) -> bool:
        return self.per_node <= self.capacity

    def to_dict(self) -> dict[str, int | bool]:
        return {
            "optimizer_bytes_per_rank": self.optimizer,
            "parameters_bytes_per_rank": self.parameters,
            "activations_bytes_per_rank": self.activations,
            "allowance_bytes_per_rank": self.allowance,
            "ranks_per_node": self.ranks_per_node,
            "total_bytes_per_node": self.per_node,
            "capacity_bytes_per_node": self.capacity,
            "fits": self.fits,
        }


def optimizer_host_bytes(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(optimizer-side, parameter) bytes one rank offloads (see the module docstring)."""
    if not layout.offload_optimizer or layout.zero_stage == 0:
        return 0.0, 0.0
    held = params_per_rank(model, layout.dims.tp, layout.dims.pp, layout.rank_layers(model.layers))
    shard = held / layout.dims.shard_group
    weight = 2 if layout.dtype == "bf16" else 4
    if layout.fsdp:
        return (4 + 4 + 8 + 4) * shard, 0.0
    parameters = weight * shard if layout.offload_parameters else 0.0
    if layout.zero_stage == 3:
        return (16 + weight) * shard, parameters
    staging = weight * largest_parameter_elements(model)
    accumulated = weight * shard if layout.grad_accum > 1 else 0.0
    return (16 + weight) * shard + accumulated + staging, parameters


def largest_parameter_elements(model: ModelSpec) -> int:
    """Elements of the model's largest single parameter tensor (DeepSpeed sizes its offload
    staging buffer by it): the embedding or head, the fused q/k/v or gate/up projection, the
    down projection (DeepSpeed runs at TP 1)."""
    h, f = model.hidden, model.ffn_hidden
    return max(model.vocab * h, (h + 2 * model.kv_hidden) * h, 2 * f * h, f * h, h * h)


def activation_host_bytes(model: ModelSpec, layout: Layout) -> float:
    """The offloaded block inputs of one rank: every block's but the last."""
    if not layout.offload_activations:
        return 0.0
    blocks = layout.rank_layers(model.layers)[0] if layout.dims.pp > 1 else model.layers
    tokens = layout.tokens_per_rank / layout.dims.tp
    return max(blocks - 1, 0) * tokens * model.hidden * layout.residual_bytes


@dataclass(frozen=True)
class HostLimit:
    """A node's host memory and how many of a job's ranks share it."""

    host_memory_bytes: int
    """One node's host memory (`ClusterSpec.host_memory_bytes`)."""
    gpus_per_node: int
    cpu: bool = False
    """gpu: cpu: the host is the device, so the ranks' device memory comes out of it too."""

    def ranks_per_node(self, layout: Layout) -> int:
        """Ranks on the busiest node: the node's GPUs, or the whole job when it is smaller."""
        return max(1, min(self.gpus_per_node, layout.dims.world_size))


def host_estimate(
    model: ModelSpec, layout: Layout, limit: HostLimit, device_bytes_per_rank: int = 0
) -> HostEstimate:
    """Host memory of the busiest node: its ranks, each holding what `layout` offloads, against
    the node's memory. On `gpu: cpu` the ranks' device memory (`device_bytes_per_rank`)
    comes out of the same memory."""
    optimizer, parameters = optimizer_host_bytes(model, layout)
    activations = activation_host_bytes(model, layout)
    ranks = limit.ranks_per_node(layout)
    capacity = int(limit.host_memory_bytes * (1 - HOST_SYSTEM_SHARE))
    if limit.cpu:
        capacity -= ranks * device_bytes_per_rank
    return HostEstimate(
        optimizer=int(optimizer),
        parameters=int(parameters),
        activations=int(activations),
        # On the CPU the process's own memory is the device allowance already.
        allowance=0 if limit.cpu else HOST_RANK_ALLOWANCE,
        ranks_per_node=ranks,
        capacity=capacity,
    )
