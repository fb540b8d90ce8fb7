"""Multi-process helpers: run a function in N fresh gloo processes with a hard deadline.

The processes are forked from a server process that has imported torch once (multiprocessing's
forkserver, per test process), not spawned: each spawned rank imported torch again, about 1.5 s
of CPU each on this 2-core machine, and the suite starts hundreds. A forked rank is as fresh as
a spawned one where it matters here: the server only imports (no thread pool, no process group,
no allocation), the rank gets the caller's environment before the test's module is imported
(the function and its arguments are unpickled only then), and sets its own thread count."""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", __name__]
"""What the fork server imports once (torch.distributed.checkpoint, which the trainer's
checkpointing imports, costs another 0.6 s of CPU a rank); a rank imports the rest (ctxlaunch,
the test module)."""


def _worker(call, environ, rank, world_size, init_file, results, threads):
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as a spawned process would have it
    fn, args = pickle.loads(call)  # imports the test's module, under that environment
    torch.set_num_threads(threads)
    # What torchrun would set (DeepSpeed insists on LOCAL_RANK).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank attached
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0, threads: int = 1):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes.

    Returns the per-rank return values. The first failing rank's traceback is raised as an
    AssertionError and every worker is killed at once, since ranks left waiting in a collective
    would hang forever; so are all workers still running after ``timeout_s``.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    call = pickle.dumps((fn, args))
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="cp_test_init_")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it; a stale one would confuse it
    procs = [
        ctx.Process(
            target=_worker,
            args=(call, dict(os.environ), rank, world_size, init_file, results, threads),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, object] = {}
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise AssertionError(
                    f"ranks {missing} did not finish within {timeout_s:.0f} s (hang?)"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode is not None and r not in values
                ]
                if dead:
                    raise AssertionError(
                        f"ranks {dead} exited without a result (exit codes "
                        f"{[procs[r].exitcode for r in dead]})"
                    ) from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return [values[r] for r in range(world_size)]
