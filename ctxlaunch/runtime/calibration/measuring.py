"""What the CPU and the GPU measurement share: the model's projection shapes, timing a call at
its best, and running measurement ranks in processes of their own (spawned, never hanging)."""

from __future__ import annotations

import os
import queue
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ctxlaunch.contract.spec import ModelSpec


def block_projections(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """The (in, out) of the trainer's weight matmuls in one block: fused q/k/v, output, fused
    gate/up, down."""
    return (
        (model.hidden, model.hidden + 2 * model.kv_hidden),
        (model.hidden, model.hidden),
        (model.hidden, 2 * model.ffn_hidden),
        (model.ffn_hidden, model.hidden),
    )


def best_seconds(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None
) -> float:
    """The best of `repeats` timed calls of `fn` after one warm-up call (thread pool, packing,
    allocator); `sync` (the device's synchronisation) runs after each call, inside its time."""
    fn()
    if sync is not None:
        sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - start)
    return best


def device_timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """best_seconds(fn, repeats) on `device`: synchronised around each call on CUDA, where
    kernels are asynchronous."""
    if device.type != "cuda":
        return best_seconds
    import torch

    def sync() -> None:
        torch.cuda.synchronize(device)

    return lambda fn, repeats: best_seconds(fn, repeats, sync)


def run_ranks(
    target: Callable[..., None],
    ranks: int,
    args: tuple[Any, ...],
    expect: int,
    timeout_s: float,
    what: str,
) -> list[Any]:
    """Run `target(rank, init_file, *args, results)` in `ranks` spawned processes; collect
    `expect` results. A process that dies or a run past `timeout_s` ends every process and
    raises RuntimeError: a measurement never hangs."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="ctxlaunch_calibrate_")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    processes = [
        ctx.Process(target=target, args=(rank, init_file, *args, results), daemon=True)
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    values: list = []
    try:
        while len(values) < expect:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not finish in {timeout_s:.0f} s")
            try:
                values.append(results.get(timeout=1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    raise RuntimeError(
                        f"{what}: a process died (exit codes {[p.exitcode for p in processes]})"
                    ) from None
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return values
