"""Constants measured on this machine for the step-time model on `gpu: cpu`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .hardware import LinkInfo
from .steptime import Machine


@dataclass(frozen=True)
class Calibration:
    """What a CPU rank achieves here: rates measured with all cores in one process."""

    matmul_flops_per_second: float
    attention_flops_per_second: float
    """Causal attention through the trainer's kernels, forward + backward, executed FLOPs."""
    memory_bytes_per_second: float
    link_bytes_per_second: float
    """gloo over loopback between two processes, one direction."""
    link_latency_seconds: float
    cores: int
    measured_at: str = ""

    def machine(self, gpus_per_node: int) -> Machine:
        """N ranks share the cores: each gets 1/N of the measured rates (they were measured
        with all cores in one process)."""
        share = max(gpus_per_node, 1)
        rate = self.matmul_flops_per_second / share
        link = LinkInfo("gloo loopback (measured)", self.link_bytes_per_second,
                        self.link_latency_seconds, f"measured {self.measured_at}")
        return Machine(name="cpu", peak_flops={"bf16": rate, "fp32": rate},
                       memory_bytes_per_second=self.memory_bytes_per_second / share,
                       gpus_per_node=gpus_per_node, nvlink_domain=gpus_per_node,
                       intra_node=link, network=link,
                       eta_matmul={"bf16": 1.0, "fp32": 1.0}, eta_comm=1.0,
                       attention_flops_per_second=self.attention_flops_per_second / share,
                       overlap_dp=False, peak_reference_flops=rate)


def calibration_path() -> Path:
    from .jobstore import home

    return home() / "cpu_calibration.json"


def load_calibration(path: Path | None = None) -> Calibration | None:
    path = path or calibration_path()
    try:
        return Calibration(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save_calibration(calibration: Calibration, path: Path | None = None) -> Path:
    from .fsutil import atomic_write_text

    return atomic_write_text(path or calibration_path(),
                             json.dumps(asdict(calibration), indent=2) + "\n")
