"""The machine a prediction runs on: the CPU calibration record that `ctxlaunch calibrate`
measures (ctxlaunch.runtime.calibrate) and `plan`, `advise`, `report` and telemetry read."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ctxlaunch.contract.fsutil import atomic_write_text
from ctxlaunch.contract.hardware import LinkInfo
from ctxlaunch.contract.rundir import home
from ctxlaunch.perf.steptime import Machine


@dataclass(frozen=True)
class Calibration:
    """What a CPU rank achieves here: rates measured with all cores in one process."""

    matmul_flops_per_second: float
    attention_flops_per_second: float
    """Attention through the trainer's kernels, forward + backward, on a full (non-causal)
    block: FLOPs per second."""
    memory_bytes_per_second: float
    link_bytes_per_second: float
    """gloo over loopback between two processes, one direction."""
    link_latency_seconds: float
    cores: int
    measured_at: str = ""
    microbatch_overhead_seconds: float = 0.0
    """One rank's fixed cost per micro-batch: the intercept of the real model's step (forward,
    backward, AdamW) at two short lengths, less what the model predicts for that work."""
    causal_tile_tokens: float = 0.0
    """What a causal call wastes on its diagonal, in tokens (see steptime.Machine)."""
    sync_seconds: dict[str, float] | None = None
    """Ranks -> the cost of one ring exchange between compute steps, beyond the compute, with
    that many processes sharing the cores."""
    elementwise_bytes_per_second: float = 0.0
    """What the model's elementwise work (norms, RoPE, SwiGLU, adds) achieves per modelled byte,
    with all cores: fitted on the real model's step at two short lengths (0: not measured, the
    copy bandwidth stands in)."""
    one_thread: dict[str, float] | None = None
    """The same rates with one thread ("matmul", "attention", "elementwise"): what a rank
    achieves when ranks outnumber or match the cores and each runs one thread. Threads in one
    process do not scale linearly, so N such ranks together outrun one process with N
    threads."""

    def _per_rank(self, all_cores: float, kind: str, share: int) -> float:
        """A rate per rank when `share` ranks divide the cores: with at least as many ranks as
        cores each runs one thread, time-sliced (the one-thread rate x cores / ranks);
        otherwise each gets 1/share of the all-core process's rate."""
        one = (self.one_thread or {}).get(kind, 0.0)
        if one > 0 and share >= self.cores:
            return one * self.cores / share
        return all_cores / share

    def machine(self, gpus_per_node: int) -> Machine:
        """N ranks share the cores (see `_per_rank`)."""
        share = max(gpus_per_node, 1)
        rate = self._per_rank(self.matmul_flops_per_second, "matmul", share)
        # Ranks filling the cores run one thread each; more ranks than cores time-slice it.
        overhead = self.microbatch_overhead_seconds
        if share >= self.cores and (self.one_thread or {}).get("microbatch_overhead"):
            overhead = self.one_thread["microbatch_overhead"]  # type: ignore[index]
        overhead *= max(1.0, share / max(self.cores, 1))
        link = LinkInfo("gloo loopback (measured)", self.link_bytes_per_second,
                        self.link_latency_seconds, f"measured {self.measured_at}")
        syncs = {int(k): v for k, v in (self.sync_seconds or {}).items()}
        nearest = min(syncs, key=lambda k: (abs(k - share), k)) if syncs else None
        sync = syncs[nearest] if nearest is not None and share > 1 else 0.0
        return Machine(name="cpu", peak_flops={"bf16": rate, "fp32": rate},
                       memory_bytes_per_second=self.memory_bytes_per_second / share,
                       gpus_per_node=gpus_per_node, nvlink_domain=gpus_per_node,
                       intra_node=link, network=link,
                       eta_matmul={"bf16": 1.0, "fp32": 1.0}, eta_comm=1.0,
                       attention_flops_per_second=self._per_rank(
                           self.attention_flops_per_second, "attention", share),
                       overlap_dp=False, peak_reference_flops=rate,
                       microbatch_overhead_seconds=overhead, sync_seconds=sync,
                       causal_tile_tokens=self.causal_tile_tokens,
                       elementwise_bytes_per_second=(self._per_rank(
                           self.elementwise_bytes_per_second, "elementwise", share) or None))


def calibration_path() -> Path:
    return home() / "cpu_calibration.json"


def load_calibration(path: Path | None = None) -> Calibration | None:
    path = path or calibration_path()
    try:
        return Calibration(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save_calibration(calibration: Calibration, path: Path | None = None) -> Path:
    return atomic_write_text(path or calibration_path(),
                             json.dumps(asdict(calibration), indent=2) + "\n")
