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
    intra_node_link: str = "pcie4"
    """Key into LINKS of the link between GPUs of one node (NVLink generation or PCIe)."""
    hbm_bytes_per_second: float = 0.0
    """Memory bandwidth (data sheet): bounds the elementwise work and the optimizer step."""
    fp8: bool = False
    """FP8 tensor cores (Hopper, Blackwell, Ada): dense FP8 peak is twice BF16's."""
    sm_count: int = 0
    """Streaming multiprocessors (data sheet): GEMM tiles fill them in waves (wave
    quantisation in the step-time model); 0: not modelled."""
    sfu_ops_per_second: float = 0.0
    """Special-function (exponential) rate: 16 per SM per clock at the boost clock of the
    dense peak (H100 SXM: 3.9e12, Shah et al. 2024, FlashAttention-3, section 3.1); bounds
    the softmax of FA2-generation attention kernels. 0: not modelled."""
    host_link: str = "pcie4"
    """Key into LINKS of the link between the GPU and its host's memory: what offloading to
    host memory (training.offload) copies over."""
    node_host_memory_bytes: int = 0
    """Host (CPU) memory of the usual node of this GPU type (its reference system's data sheet,
    HOST_MEMORY_SOURCES): what offloading may fill unless `cluster.host_memory_gib` says
    otherwise. On "cpu" the host is the device: the same memory."""
    node_host_bytes_per_second: float = 0.0
    """Host memory bandwidth of that node (its DDR channels, data sheet): what an offloaded
    optimizer's step on the CPU streams at, shared by the node's ranks."""
    board_power_watts: float = 0.0
    """The board's maximum power (data sheet TDP; POWER_SOURCES): what the GPU draws while it
    computes. 0: not known (the energy estimate is then left out)."""
    node_other_power_watts: float = 0.0
    """What the rest of the usual node of this GPU type draws (CPUs, memory, NICs, switches,
    fans): its reference system's maximum power less its GPUs' board power (POWER_SOURCES),
    counted for the whole run."""


DDR5_SOCKET_BYTES_PER_SECOND = 8 * 4800e6 * 8
"""One CPU socket's DDR5 bandwidth: 8 channels of DDR5-4800, 8 bytes a transfer (Xeon
Sapphire Rapids, the CPU of DGX H100 and H200 systems; data sheet)."""
DDR4_SOCKET_BYTES_PER_SECOND = 8 * 3200e6 * 8
"""One CPU socket's DDR4 bandwidth: 8 channels of DDR4-3200 (EPYC Rome, DGX A100's CPU)."""

HOST_MEMORY_SOURCES = {
    "H100": "DGX H100 data sheet: 2 TB system memory for 8 GPUs",
    "H200": "DGX H200 data sheet: 2 TB system memory for 8 GPUs",
    "B200": "DGX B200 data sheet: 2 TB system memory (up to 4 TB) for 8 GPUs",
    "A100": "DGX A100 640GB data sheet: 2 TB system memory for 8 GPUs",
    "A100-40GB": "DGX A100 320GB data sheet: 1 TB system memory for 8 GPUs",
    "L40S": "a typical 8 x L40S PCIe server (OVX-class): 1 TB system memory",
}
"""Where each GPU type's usual node host memory (GpuInfo.node_host_memory_bytes) comes from."""

POWER_SOURCES = {
    "H100": "H100 SXM5 data sheet: up to 700 W per GPU; DGX H100 data sheet: about 10.2 kW "
    "maximum system power for 8 GPUs, so 10,200 - 8 x 700 = 4,600 W for the rest of the node",
    "H200": "H200 SXM data sheet: up to 700 W per GPU; DGX H200 data sheet: about 10.2 kW "
    "maximum system power for 8 GPUs, so 4,600 W for the rest of the node",
    "B200": "HGX B200: up to 1,000 W per GPU; DGX B200 data sheet: about 14.3 kW maximum system "
    "power for 8 GPUs, so 14,300 - 8 x 1,000 = 6,300 W for the rest of the node",
    "A100": "A100 SXM4 data sheet: 400 W per GPU; DGX A100 data sheet: 6.5 kW maximum system "
    "power for 8 GPUs, so 6,500 - 8 x 400 = 3,300 W for the rest of the node",
    "A100-40GB": "A100 SXM4 data sheet: 400 W per GPU; DGX A100 data sheet: 6.5 kW maximum "
    "system power, so 3,300 W for the rest of the node",
    "L40S": "L40S data sheet: 350 W per GPU; no reference system states a maximum for an 8 x "
    "L40S server, so the DGX A100's 3,300 W for the rest of a two-socket node stands in",
    "cpu": "not known: a CPU rank's share of its package power is not in the table, so no "
    "energy is estimated",
}
"""Where each GPU type's power figures (GpuInfo.board_power_watts, node_other_power_watts) come
from."""
REFERENCE_NODE_GPUS = 8
"""GPUs of the reference systems POWER_SOURCES names: the rest of the node's power is shared
among this many (a node of 4 GPUs is charged half of it)."""

# Sources: NVIDIA data sheets (dense figures) and ../shared/docs/domain.md; H100 means SXM.
# Memory is what `torch.cuda.get_device_properties(i).total_memory` reports on such a GPU
# (nvidia-smi's total less the driver's reservation), not the marketing figure: the planner
# compares against what an allocator can actually get.
GPUS: dict[str, GpuInfo] = {
    # HBM bandwidths: H100 SXM 3.35 TB/s, H200 4.8 TB/s, B200 8 TB/s, A100 80GB 2.04 TB/s,
    # A100 40GB 1.56 TB/s, L40S 864 GB/s (GDDR6).
    "H100": GpuInfo(
        "H100",
        int(79.1 * GiB),
        989 * TFLOPS,
        494.5 * TFLOPS,
        8,
        True,
        intra_node_link="nvlink4",
        hbm_bytes_per_second=3.35e12,
        fp8=True,
        sm_count=132,
        sfu_ops_per_second=3.9e12,
        host_link="pcie5",
        node_host_memory_bytes=2000 * GB,
        node_host_bytes_per_second=2 * DDR5_SOCKET_BYTES_PER_SECOND,
        board_power_watts=700,
        node_other_power_watts=4600,
    ),
    "H200": GpuInfo(
        "H200",
        int(139.8 * GiB),
        989 * TFLOPS,
        494.5 * TFLOPS,
        8,
        True,
        intra_node_link="nvlink4",
        hbm_bytes_per_second=4.8e12,
        fp8=True,
        sm_count=132,
        sfu_ops_per_second=3.9e12,
        host_link="pcie5",
        node_host_memory_bytes=2000 * GB,
        node_host_bytes_per_second=2 * DDR5_SOCKET_BYTES_PER_SECOND,
        board_power_watts=700,
        node_other_power_watts=4600,
    ),
    # DGX B200: 1,440 GB over 8 GPUs (180 GB each), not the 192 GB chip figure.
    "B200": GpuInfo(
        "B200",
        int(179.0 * GiB),
        2250 * TFLOPS,
        1125 * TFLOPS,
        8,
        True,
        intra_node_link="nvlink5",
        hbm_bytes_per_second=8.0e12,
        fp8=True,
        sm_count=148,
        host_link="pcie5",
        node_host_memory_bytes=2000 * GB,
        node_host_bytes_per_second=2 * DDR5_SOCKET_BYTES_PER_SECOND,
        board_power_watts=1000,
        node_other_power_watts=6300,
    ),
    "A100": GpuInfo(
        "A100",
        int(79.1 * GiB),
        312 * TFLOPS,
        156 * TFLOPS,
        8,
        True,
        intra_node_link="nvlink3",
        hbm_bytes_per_second=2.04e12,
        sm_count=108,
        sfu_ops_per_second=108 * 16 * 1.41e9,
        host_link="pcie4",
        node_host_memory_bytes=2000 * GB,
        node_host_bytes_per_second=2 * DDR4_SOCKET_BYTES_PER_SECOND,
        board_power_watts=400,
        node_other_power_watts=3300,
    ),
    "A100-40GB": GpuInfo(
        "A100-40GB",
        int(39.4 * GiB),
        312 * TFLOPS,
        156 * TFLOPS,
        8,
        True,
        intra_node_link="nvlink3",
        hbm_bytes_per_second=1.56e12,
        sm_count=108,
        sfu_ops_per_second=108 * 16 * 1.41e9,
        host_link="pcie4",
        node_host_memory_bytes=1000 * GB,
        node_host_bytes_per_second=2 * DDR4_SOCKET_BYTES_PER_SECOND,
        board_power_watts=400,
        node_other_power_watts=3300,
    ),
    # PCIe only: no NVLink, so CP between two L40S crosses the PCIe bus.
    "L40S": GpuInfo(
        "L40S",
        int(44.4 * GiB),
        362 * TFLOPS,
        183 * TFLOPS,
        1,
        False,
        intra_node_link="pcie4",
        hbm_bytes_per_second=0.864e12,
        fp8=True,
        sm_count=142,
        host_link="pcie4",
        node_host_memory_bytes=1000 * GB,
        node_host_bytes_per_second=2 * DDR5_SOCKET_BYTES_PER_SECOND,
        board_power_watts=350,
        node_other_power_watts=3300,
    ),
    # "cpu" is one process on the local CPU (the local demo). Its peak is measured at run
    # time by the trainer; the figures here only keep the planner's arithmetic total.
    "cpu": GpuInfo(
        "cpu",
        16 * GiB,
        0.2 * TFLOPS,
        0.1 * TFLOPS,
        1,
        False,
        intra_node_link="loopback",
        hbm_bytes_per_second=10e9,
        host_link="memcpy",
        node_host_memory_bytes=16 * GiB,
    ),
}


def gpu_info(name: str) -> GpuInfo:
    """Look up a GPU type; the spec validates the name, so a KeyError here is a bug."""
    return GPUS[name]


@dataclass(frozen=True)
class LinkInfo:
    """One kind of link, as the step-time model sees it: a per-GPU, one-direction bandwidth and
    a per-message latency."""

    name: str
    bytes_per_second: float
    """Data-sheet bandwidth per GPU in one direction (a node's NIC shared by its GPUs is
    divided among them)."""
    latency_seconds: float
    """Typical small-message latency of one NCCL step over the link (order of magnitude: it
    matters only for the smallest messages)."""
    source: str


GBIT = 1e9 / 8  # bytes per second in one Gbit/s

# Bandwidths are data-sheet figures; latencies are typical NCCL-tests small-message figures,
# not data-sheet values (stated in the docs' step-time model page). Inter-node figures assume one NIC per GPU, as
# in DGX/HGX H100, H200 and B200 systems and AWS p5 instances.
LINKS: dict[str, LinkInfo] = {
    "nvlink3": LinkInfo("NVLink 3", 300e9, 3e-6, "A100: 600 GB/s bidirectional per GPU"),
    "nvlink4": LinkInfo("NVLink 4", 450e9, 3e-6, "H100/H200: 900 GB/s bidirectional per GPU"),
    "nvlink5": LinkInfo("NVLink 5", 900e9, 3e-6, "B200: 1.8 TB/s bidirectional per GPU"),
    "pcie4": LinkInfo("PCIe Gen4 x16", 32e9, 5e-6, "PCIe 4.0 x16: 32 GB/s per direction"),
    "pcie5": LinkInfo("PCIe Gen5 x16", 64e9, 5e-6, "PCIe 5.0 x16: 64 GB/s per direction"),
    # On gpu: cpu the host is the device: an offload copy is a copy within the same memory,
    # which the CPU calibration's memory rate times (perf.steptime reads it, not this figure).
    "memcpy": LinkInfo("host memory copy", 10e9, 1e-6, "the CPU's own memory"),
    "infiniband-ndr": LinkInfo(
        "InfiniBand NDR", 400 * GBIT, 5e-6, "ConnectX-7 NDR: 400 Gb/s per port, one port per GPU"
    ),
    "infiniband-hdr": LinkInfo(
        "InfiniBand HDR", 200 * GBIT, 5e-6, "ConnectX-6 HDR: 200 Gb/s per port, one port per GPU"
    ),
    "roce": LinkInfo("RoCE v2", 400 * GBIT, 8e-6, "400 GbE per GPU (Meta's Llama 3 RoCE cluster)"),
    "efa": LinkInfo("AWS EFA", 400 * GBIT, 15e-6, "p5: 3,200 Gb/s EFA over 8 GPUs"),
    "tcp": LinkInfo("TCP", 100 * GBIT / 8, 30e-6, "one 100 GbE NIC per 8-GPU node, shared"),
    # This machine's loopback under gloo; the figures here only keep the arithmetic total:
    # `ctxlaunch calibrate` measures the real ones.
    "loopback": LinkInfo("gloo loopback", 1e9, 50e-6, "measured by ctxlaunch calibrate"),
}


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
