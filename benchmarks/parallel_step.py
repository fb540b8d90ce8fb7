"""Step time of the trainer at TP 2 and PP 2 against one process (same model, same tokens, one
run), and the share of each step spent blocked in each dimension's communication.

    .venv/bin/python benchmarks/parallel_step.py [--seq 4096] [--steps 4] [--preset small]

Every layout runs the trainer's own `train_step` on the same global batch (2 sequences, as 2
micro-batches: 1F1B needs more than one). One torch thread per process: the machine has 2
cores, so TP 2 and PP 2 use both while the single process gets one (also run with 2 threads).
Exposed communication: wall time inside the blocking TP collectives (all-gather,
reduce-scatter, all-reduce on the TP group) and inside the pipeline schedule's waits on its
sends and receives; the first step (warm-up) is left out. Prints one JSON line per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict


def _worker(rank, world, init_file, spec_data, steps, threads, results):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    exposed: dict[str, float] = defaultdict(float)
    timing = {"on": False}

    def timed(dim, fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if timing["on"]:
                    group = kwargs.get("group")
                    name = "tp" if group is not None and group is ctx.tp_group else dim
                    exposed[name] += time.perf_counter() - start

        return run

    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        setattr(dist, name, timed("other", getattr(dist, name)))
    import torch.distributed.pipelining.schedules as schedules

    schedules._wait_batch_p2p = timed("pp", schedules._wait_batch_p2p)
    trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    trainer.train_step()  # warm-up
    timing["on"] = True
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        seconds.append(time.perf_counter() - start)
    results.put(
        (
            rank,
            {
                "step_seconds": sum(seconds) / len(seconds),
                "exposed_seconds_per_step": {k: v / steps for k, v in exposed.items()},
            },
        )
    )
    if world > 1:
        dist.destroy_process_group()


def run(world: int, spec_data: dict, steps: int, threads: int) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="parallel_step_")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(target=_worker, args=(r, world, init_file, spec_data, steps, threads, results))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=1800) for _ in range(world))
    for proc in procs:
        proc.join(timeout=60)
    return [out[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    from ctxlaunch.contract.loader import apply_overrides, validate_spec

    base = {
        "name": "bench",
        "model": {"preset": args.preset, "dtype": "fp32"},
        "training": {
            "seq_len": args.seq,
            "micro_batch": 1,
            "global_batch": 2,
            "steps": args.steps + 1,
            "optimizer": {"warmup_steps": 1},
        },
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }
    layouts = [
        ("single, 1 thread", 1, [], 1),
        ("single, 2 threads", 1, [], 2),
        ("TP 2", 2, ["parallel.tp=2"], 1),
        ("PP 2", 2, ["parallel.pp=2"], 1),
    ]
    for label, world, sets, threads in layouts:
        data = validate_spec(apply_overrides(base, [f"cluster.gpus_per_node={world}", *sets]))
        ranks = run(world, data.model_dump(mode="json"), args.steps, threads)
        step = max(r["step_seconds"] for r in ranks)
        shares = {
            f"rank {i}": {
                dim: round(s / r["step_seconds"], 3)
                for dim, s in r["exposed_seconds_per_step"].items()
            }
            for i, r in enumerate(ranks)
        }
        print(
            json.dumps(
                {
                    "layout": label,
                    "seq_len": args.seq,
                    "preset": args.preset,
                    "step_seconds": round(step, 3),
                    "exposed_share": shares,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
