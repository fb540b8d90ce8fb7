"""The hardware tables: GPU types (memory, peak FLOP/s, NVLink domain) and fabric NCCL defaults.

One table each, so the planner, the renderer and the telemetry read the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GiB = 1024**3
GB = 1000**3
TFLOPS = 1e12

GpuType = Literal["H100", "H200", "B200", "A100", "A100-40GB", "L40S", "cpu"]
NetworkType = Literal["infiniband-ndr", "infiniband-hdr", "roce", "efa", "tcp"]


@dataclass(frozen=True)
class GpuInfo:
    """What the planner and MFU need to know about one accelerator."""

    name: str
    memory_bytes: int
    """Memory the framework can allocate on one device (the marketing figure for HBM)."""
    peak_bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s (no sparsity)."""
    peak_fp32_flops: float
    """Dense FP32 peak (TF32 tensor cores where the GPU has them), FLOP/s."""
    nvlink_domain: int
    """GPUs that share NVLink/NVSwitch bandwidth; 1 for PCIe-only parts."""
    nvlink: bool
    """False for PCIe-only parts: CP traffic between them crosses the PCIe bus."""


# Sources: NVIDIA data sheets (dense figures) and ../shared/docs/domain.md; H100 means SXM.
# Memory is what `torch.cuda.get_device_properties(i).total_memory` reports on such a GPU
# (nvidia-smi's total less the driver's reservation), not the marketing figure: the planner
# compares against what an allocator can actually get.
GPUS: dict[str, GpuInfo] = {
    "H100": GpuInfo("H100", int(79.1 * GiB), 989 * TFLOPS, 494.5 * TFLOPS, 8, True),
    "H200": GpuInfo("H200", int(139.8 * GiB), 989 * TFLOPS, 494.5 * TFLOPS, 8, True),
    # DGX B200: 1,440 GB over 8 GPUs (180 GB each), not the 192 GB chip figure.
    "B200": GpuInfo("B200", int(179.0 * GiB), 2250 * TFLOPS, 1125 * TFLOPS, 8, True),
    "A100": GpuInfo("A100", int(79.1 * GiB), 312 * TFLOPS, 156 * TFLOPS, 8, True),
    "A100-40GB": GpuInfo("A100-40GB", int(39.4 * GiB), 312 * TFLOPS, 156 * TFLOPS, 8, True),
    # PCIe only: no NVLink, so CP between two L40S crosses the PCIe bus.
    "L40S": GpuInfo("L40S", int(44.4 * GiB), 362 * TFLOPS, 183 * TFLOPS, 1, False),
    # "cpu" is one process on this machine's CPU (the local demo). Its peak is measured at run
    # time by the trainer; the figures here only keep the planner's arithmetic total.
    "cpu": GpuInfo("cpu", 16 * GiB, 0.2 * TFLOPS, 0.1 * TFLOPS, 1, False),
}


def gpu_info(name: str) -> GpuInfo:
    """Look up a GPU type; the spec validates the name, so a KeyError here is a bug."""
    return GPUS[name]


# Per-fabric NCCL defaults; a job's `fabric.nccl` overrides them key by key.
# Every GPU fabric gets the PyTorch watchdog settings: fail fast with a flight-recorder dump
# rather than hang (users' most common complaint about NCCL).
COMMON_NCCL_ENV: dict[str, str] = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}

FABRIC_NCCL_ENV: dict[str, dict[str, str]] = {
    "infiniband-ndr": {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_TIMEOUT": "22",
        "NCCL_IB_QPS_PER_CONNECTION": "2",
        "NCCL_CROSS_NIC": "0",
    },
    "infiniband-hdr": {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_TIMEOUT": "22",
        "NCCL_CROSS_NIC": "0",
    },
    "roce": {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_TIMEOUT": "22",
        "NCCL_CROSS_NIC": "0",
    },
    "efa": {
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
    },
    "tcp": {
        # No RDMA on this fabric: say so, so NCCL never probes for HCAs.
        "NCCL_IB_DISABLE": "1",
    },
}

RDMA_NETWORKS = frozenset({"infiniband-ndr", "infiniband-hdr", "roce"})
