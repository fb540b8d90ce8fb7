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


# --------------------------------------------------------------------------------------------
# measuring (torch imported here only)
# --------------------------------------------------------------------------------------------
def _best_seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    import time

    fn()  # warm-up: thread pool, packing, allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_compute(*, heads: int = 4, head_dim: int = 32, seq: int = 2048,
                    dtype: str = "fp32", repeats: int = 5) -> tuple[float, float, float]:
    """(matmul FLOP/s, causal attention FLOP/s forward + backward, copy bytes/s), each the best
    of `repeats` runs with all of this machine's cores in this process. Attention runs through
    the trainer's own kernels (ctxlaunch.cp.kernels) at the model's heads and head_dim; its
    FLOPs are counted as the step-time model counts them (12 x heads x head_dim x s x s/2)."""
    import os

    import torch

    from .cp.kernels import attention_backward, attention_forward

    torch.set_num_threads(os.cpu_count() or 1)
    kind = torch.float32 if dtype == "fp32" else torch.bfloat16
    n = 1024
    a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
    matmul = 2.0 * n**3 / _best_seconds(lambda: torch.mm(a, b), repeats)

    q = torch.randn(1, heads, seq, head_dim, dtype=kind)
    k, v = torch.randn_like(q), torch.randn_like(q)
    scale = head_dim**-0.5

    def attention() -> None:
        out, lse = attention_forward(q, k, v, True, scale)
        attention_backward(torch.ones_like(out), q, k, v, out, lse, True, scale)

    attention_rate = 12.0 * heads * head_dim * seq * seq / 2 / _best_seconds(attention, repeats)

    x = torch.empty(16 * 2**20, dtype=torch.float32)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 4 / _best_seconds(lambda: y.copy_(x), repeats)
    return matmul, attention_rate, copy


def _pingpong(rank: int, init_file: str, sizes: list[int], repeats: int, results) -> None:  # type: ignore[no-untyped-def]
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = []
    for size in sizes:
        buffer = torch.empty(size // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            best = min(best, (time.perf_counter() - start) / 2)
        out.append(best)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def measure_loopback(sizes: tuple[int, ...] = (4096, 262144, 4 * 2**20, 16 * 2**20),
                     repeats: int = 5, timeout_s: float = 120.0) -> tuple[float, float]:
    """(bytes/s, latency s) of gloo point-to-point between two processes over 127.0.0.1: the
    least-squares line through the best one-way time at each message size."""
    import os
    import queue
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="ctxlaunch_calibrate_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_pingpong, args=(r, init_file, list(sizes), repeats, results),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        times = results.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"gloo loopback measurement did not finish in {timeout_s:.0f} s") \
            from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(times) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, times))
             / sum((x - mean_x) ** 2 for x in sizes))
    bandwidth = 1.0 / slope
    # The smallest message's time less its transfer: the intercept of a line through four
    # points this far apart is too noisy to use.
    latency = max(times[0] - sizes[0] / bandwidth, 1e-6)
    return bandwidth, latency


def measure(*, heads: int = 4, head_dim: int = 32, seq: int = 2048, dtype: str = "fp32",
            repeats: int = 5, sizes: tuple[int, ...] = (4096, 262144, 4 * 2**20, 16 * 2**20)
            ) -> Calibration:
    """Every constant the step-time model needs on this CPU."""
    import datetime
    import os

    matmul, attention, copy = measure_compute(heads=heads, head_dim=head_dim, seq=seq,
                                              dtype=dtype, repeats=repeats)
    bandwidth, latency = measure_loopback(sizes=sizes, repeats=repeats)
    return Calibration(matmul_flops_per_second=matmul, attention_flops_per_second=attention,
                       memory_bytes_per_second=copy, link_bytes_per_second=bandwidth,
                       link_latency_seconds=latency, cores=os.cpu_count() or 1,
                       measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(
                           timespec="seconds"))
