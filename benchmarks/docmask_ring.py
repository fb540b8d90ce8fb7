# Shapes: full q, k, v (B, H, S, D); each of N gloo processes holds (B, H, S/N, D) shards.
"""Document-masked ring attention against unmasked ring attention at the same tokens (CPU/gloo).

    PYTHONPATH=. .venv/bin/python benchmarks/docmask_ring.py [--seq 8192 16384] [--documents 8]

N spawned processes (one torch thread each) run ring attention forward+backward over a packed
sequence of ``--documents`` documents of seeded uneven lengths, masked (``documents=``) and
unmasked, zigzag and contiguous, interleaved (A B C D, A B C D, ...). Prints a markdown table
of the slowest rank's median step time, and ``attention_area``'s count of what the mask saves.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxlaunch.cp import attention_area, ring_attention, shard_sequence


def documents_for(seq_len: int, count: int, seed: int = 0) -> tuple[int, ...]:
    """Boundaries of ``count`` documents of seeded uneven lengths covering ``seq_len`` tokens."""
    cuts = sorted(random.Random(seed).sample(range(1, seq_len), count - 1))
    return (0, *cuts, seq_len)


def _step(shards, layout, documents):
    def step():
        q, k, v = (t.detach().requires_grad_() for t in shards[:3])
        ring_attention(q, k, v, None, sharding=layout, documents=documents).backward(shards[3])

    return step


def _worker(rank, world_size, init_file, args, results):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    out = {}
    for seq_len in args.seq:
        documents = [documents_for(seq_len, args.documents)]
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, args.heads, seq_len, args.head_dim, generator=g) for _ in range(4)]
        shards = {
            layout: [shard_sequence(t, None, 2, layout) for t in full]
            for layout in ("zigzag", "contiguous")
        }

        variants = {
            (layout, masked): _step(shards[layout], layout, documents if masked else None)
            for layout in ("zigzag", "contiguous")
            for masked in (False, True)
        }
        times = {name: [] for name in variants}
        for _ in range(args.reps + 1):
            for name, fn in variants.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
        out[seq_len] = {name: statistics.median(t[1:]) for name, t in times.items()}
    results.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="docmask_bench_")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(target=_worker, args=(r, args.cp, init_file, args, results))
        for r in range(args.cp)
    ]
    for p in procs:
        p.start()
    per_rank = dict(results.get() for _ in procs)
    for p in procs:
        p.join()

    print(
        f"B=1 H={args.heads} D={args.head_dim} fp32, CP {args.cp}, {args.documents} documents "
        f"per sequence, ring fwd+bwd seconds (median of {args.reps}, slowest rank)\n"
    )
    print(
        "| S | document lengths | layout | unmasked s | masked s | speed-up | computed area "
        "| busiest rank's area | blocks skipped | kernel calls (fwd, all ranks) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq_len in args.seq:
        bounds = documents_for(seq_len, args.documents)
        lengths = ", ".join(str(b - a) for a, b in zip(bounds, bounds[1:]))
        for layout in ("zigzag", "contiguous"):
            plain = max(per_rank[r][seq_len][(layout, False)] for r in per_rank)
            masked = max(per_rank[r][seq_len][(layout, True)] for r in per_rank)
            area = attention_area([bounds], seq_len, args.cp, layout)
            print(
                f"| {seq_len} | {lengths} | {layout} | {plain:.3f} | {masked:.3f} | "
                f"{plain / masked:.2f}x | {area.computed_fraction:.1%} | {area.critical_fraction:.1%} "
                f"| {area.blocks_skipped} of {area.blocks_skipped + area.blocks_computed} | {area.pieces} |"
            )


if __name__ == "__main__":
    main()
