# Shapes: full q, k, v (B, H, S, D); each of N gloo processes holds (B, H, S/N, D) shards.
"""Context-parallel attention on CPU/gloo, measured side by side with its peers in one run.

    .venv/bin/python benchmarks/cp_attention.py [--seq 8192 16384] [--heads 8] [--head-dim 64]

1. ring forward+backward vs PyTorch's ``_templated_ring_attention`` (+ its backward),
2. Ulysses forward+backward vs DeepSpeed's ``DistributedAttention``,
3. load balance: slowest rank's kernel CPU time over the fastest's, zigzag vs contiguous,
4. overlap: ring step time with a simulated per-transfer link delay vs max(compute, delay).

Each CP degree runs as N spawned processes with one torch thread each (this machine has 2
cores, so CP 4 oversubscribes them 2x). Causal attention throughout. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import ctxlaunch.cp.kernels as cp_kernels
from ctxlaunch.cp import ring_attention, shard_sequence, simulated_link_delay, ulysses_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(seq_len, heads, head_dim, dtype, layout, seq_first=False):
    """This rank's shards of q, k, v and the upstream gradient (same full tensors on every rank)."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, heads, seq_len, head_dim, generator=g).to(dtype) for _ in range(4)]
    shards = [shard_sequence(t, None, 2, layout) for t in full]
    if seq_first:
        # (B, S/N, H, D) storage, as a model's projections produce it; SDPA layout is a view.
        shards = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in shards]
    return shards


def _timed(steps, reps):
    """Per-repetition wall time of each of ``steps`` (name -> callable) on this rank.

    Repetitions interleave the steps (A B C A B C ...) so that load from outside the benchmark
    shifts all of them alike; barriers line the ranks up. One warm-up round is dropped.
    """
    times = {name: [] for name in steps}
    for _ in range(reps + 1):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return {name: t[1:] for name, t in times.items()}


def _median_time(step, reps):
    return statistics.median(_timed({"step": step}, reps)["step"])


def _ours_ring(shards, layout, backward=True):
    def step():
        q, k, v = (t.detach().requires_grad_(backward) for t in shards[:3])
        out = ring_attention(q, k, v, None, causal=True, sharding=layout)
        if backward:
            out.backward(shards[3])

    return step


def _torch_ring(shards, load_balance):
    from torch.distributed.tensor.experimental._attention import (
        _cp_options,
        _templated_ring_attention,
    )
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    aten = torch.ops.aten
    q, k, v, grad = shards

    def step():
        _cp_options.enable_load_balance = load_balance
        out, lse = _templated_ring_attention(
            dist.group.WORLD,
            2,
            aten._scaled_dot_product_flash_attention_for_cpu,
            q,
            k,
            v,
            is_causal=True,
            dropout_p=0.0,
        )[:2]
        _templated_ring_attention_backward(
            dist.group.WORLD,
            2,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad,
            grad_out_name="grad_out",
            query=q,
            key=k,
            value=v,
            out=out,
            logsumexp=lse,
            is_causal=True,
            dropout_p=0.0,
        )

    return step


def _ours_ulysses(shards):
    def step():
        q, k, v = (t.detach().requires_grad_() for t in shards[:3])
        ulysses_attention(q, k, v, None, causal=True, sharding="contiguous").backward(shards[3])

    return step


def _sdpa_bshd(q, k, v):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)


def _deepspeed_ulysses(shards):
    from deepspeed.sequence.layer import DistributedAttention

    attention = DistributedAttention(_sdpa_bshd, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    # DeepSpeed's layout is [b, s/p, h, d]: the same storage, seen seq-first.
    q, k, v, grad = (t.transpose(1, 2) for t in shards)

    def step():
        ins = [t.detach().requires_grad_() for t in (q, k, v)]
        attention(*ins, 0).backward(grad)

    return step


class _KernelClock:
    """Sums the CPU time this thread spends in attention kernels (one torch thread: the kernel
    runs on the calling thread, so contention from other processes does not inflate it)."""

    def __init__(self):
        self.seconds = 0.0
        self._originals = (cp_kernels.attention_forward, cp_kernels.attention_backward)

    def _wrap(self, fn):
        def timed(*args):
            start = time.thread_time()
            result = fn(*args)
            self.seconds += time.thread_time() - start
            return result

        return timed

    def __enter__(self):
        cp_kernels.attention_forward, cp_kernels.attention_backward = map(
            self._wrap, self._originals
        )
        return self

    def __exit__(self, *exc):
        cp_kernels.attention_forward, cp_kernels.attention_backward = self._originals


def _worker(rank, world_size, init_file, args, results):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for seq_len in args.seq:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            key = (world_size, seq_len, dtype_name)
            zz = _inputs(seq_len, args.heads, args.head_dim, dtype, "zigzag")
            ct = _inputs(seq_len, args.heads, args.head_dim, dtype, "contiguous")
            ct_seq_first = _inputs(
                seq_len, args.heads, args.head_dim, dtype, "contiguous", seq_first=True
            )
            timings = _timed(
                {
                    "ring zigzag (ours)": _ours_ring(zz, "zigzag"),
                    "ring head-tail (torch)": _torch_ring(zz, True),
                    "ring contiguous (ours)": _ours_ring(ct, "contiguous"),
                    "ring contiguous (torch)": _torch_ring(ct, False),
                    "ulysses (ours)": _ours_ulysses(ct_seq_first),
                    "ulysses (deepspeed)": _deepspeed_ulysses(ct_seq_first),
                },
                args.reps,
            )
            out[("time",) + key] = timings
            if dtype_name == "fp32":
                for layout, shards in (("zigzag", zz), ("contiguous", ct)):
                    with _KernelClock() as clock:
                        _ours_ring(shards, layout)()
                    out[("kernel", layout) + key] = clock.seconds
                if seq_len == min(args.seq):
                    out[("overlap",) + key] = _overlap(zz, args.reps, world_size)
    results.put((rank, out))
    dist.destroy_process_group()


OVERLAP_FACTORS = (0.5, 1.0, 2.0)


def _overlap(shards, reps, world_size):
    """Ring fwd+bwd with every transfer delayed by ``factor`` times one forward ring step's
    compute (forward time / N), for each factor, interleaved with undelayed runs: the undelayed
    step time and, per factor, (delay per transfer, step time), seconds."""
    forward_step = _median_time(_ours_ring(shards, "zigzag", backward=False), reps) / world_size
    ring = _ours_ring(shards, "zigzag")

    def delayed(seconds):
        def step():
            with simulated_link_delay(seconds):
                ring()

        return step

    steps = {"none": ring} | {factor: delayed(factor * forward_step) for factor in OVERLAP_FACTORS}
    times = {name: statistics.median(t) for name, t in _timed(steps, reps).items()}
    return times["none"], [(factor * forward_step, times[factor]) for factor in OVERLAP_FACTORS]


def _run(world_size, args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="cp_bench_"), "init")
    # Daemons: if a rank hangs past --timeout, the parent raises and takes them down with it.
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, init_file, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    per_rank = dict(results.get(timeout=args.timeout) for _ in procs)
    for p in procs:
        p.join()
    return [per_rank[r] for r in range(world_size)]


def _step_time(per_rank, key, name):
    """Median over repetitions of the slowest rank's time."""
    reps = zip(*(r[key][name] for r in per_rank))
    return statistics.median(max(rep) for rep in reps)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()

    results = {n: _run(n, args) for n in args.cp}
    print(
        f"B=1 H={args.heads} D={args.head_dim}, causal, fwd+bwd seconds (median of {args.reps}, slowest rank)\n"
    )
    print(
        "| CP | S | dtype | ring zigzag ours | torch head-tail | ratio | ring contig ours | torch contig | ratio "
        "| ulysses ours | deepspeed | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, per_rank in results.items():
        for seq_len in args.seq:
            for dtype_name in args.dtypes:
                key = ("time", n, seq_len, dtype_name)
                t = {name: _step_time(per_rank, key, name) for name in per_rank[0][key]}
                pairs = [
                    ("ring zigzag (ours)", "ring head-tail (torch)"),
                    ("ring contiguous (ours)", "ring contiguous (torch)"),
                    ("ulysses (ours)", "ulysses (deepspeed)"),
                ]
                cells = " | ".join(
                    f"{t[a]:.3f} | {t[b]:.3f} | {t[a] / t[b]:.2f}x" for a, b in pairs
                )
                print(f"| {n} | {seq_len} | {dtype_name} | {cells} |")

    print("\nLoad balance: kernel CPU seconds per rank (fwd+bwd, fp32), slowest/fastest\n")
    print("| CP | S | layout | per-rank kernel seconds | max/min |")
    print("|---|---|---|---|---|")
    for n, per_rank in results.items():
        for seq_len in args.seq:
            for layout in ("zigzag", "contiguous"):
                secs = [r[("kernel", layout, n, seq_len, "fp32")] for r in per_rank]
                times = ", ".join(f"{s:.2f}" for s in secs)
                print(f"| {n} | {seq_len} | {layout} | {times} | {max(secs) / min(secs):.3f} |")

    print(
        f"\nOverlap: ring zigzag fwd+bwd, fp32, S={min(args.seq)}, every transfer delayed by d = factor x "
        "(forward time / N); total delay = (2N-1) d, the transfer chain of one fwd+bwd\n"
    )
    print(
        "| CP | factor | d s | compute s | total delay s | max s | sum s | measured s | measured/max |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, per_rank in results.items():
        key = ("overlap", n, min(args.seq), "fp32")
        compute = max(r[key][0] for r in per_rank)
        for i, factor in enumerate(OVERLAP_FACTORS):
            delay = max(r[key][1][i][0] for r in per_rank)
            measured = max(r[key][1][i][1] for r in per_rank)
            total = (2 * n - 1) * delay
            bound = max(compute, total)
            print(
                f"| {n} | {factor} | {delay:.3f} | {compute:.3f} | {total:.3f} | {bound:.3f} | "
                f"{compute + total:.3f} | {measured:.3f} | {measured / bound:.2f} |"
            )


if __name__ == "__main__":
    main()
