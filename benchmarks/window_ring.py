# Shapes: full q (B, H, S, D), k, v (B, Hkv, S, D); each of N gloo processes holds (B, H, S/N, D) shards.
"""A local (sliding-window) layer under CP on the CPU: the window-aware exchange against the full
ring with the window applied as a mask, and against one process's local attention.

    PYTHONPATH=. .venv/bin/python benchmarks/window_ring.py [--seq 16384] [--window 1024]
        [--cp 4 8] [--out benchmarks/results/window_ring-DATE.json]

For each CP degree, N spawned processes (one torch thread each) run one local layer's attention
forward + backward over the same seeded tokens, zigzag-sharded, two ways, interleaved:

- window-aware: ``ring_attention(..., window=W)``, whose ranks exchange only the K/V rows some
  query of theirs sees (the halo) and compute only the window's pieces;
- full ring, masked: every K/V shard travels N - 1 hops forward and again with its fp32 dK/dV
  backward (as the unwindowed ring), and every block is computed whole with the window as an
  additive mask (what a ring that does not know the window must do to be exact).

Both are checked against each other (out and gradients). Bytes are what each rank's commits
sent (``comm.commit_sizes``), the busiest rank's. Then one process of one thread runs
``full_attention(..., window=W)`` on the whole sequence: the same work on the same tokens
without CP. Times are the median of ``--reps`` of the slowest rank's forward + backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxlaunch.cp import full_attention, kernels, ring_attention, shard_positions, shard_sequence
from ctxlaunch.cp.comm import RingComm, commit_sizes
from ctxlaunch.cp.merge import merge_block


def _band(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, dtype: torch.dtype):
    """The additive window mask of queries at q_pos over keys at k_pos, and the rows it hides
    whole."""
    d = q_pos[:, None] - k_pos[None, :]
    seen = (d >= 0) & (d < window)
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
    return mask, ~seen.any(dim=1)


class MaskedRing(torch.autograd.Function):
    """The full ring with the window as a mask: N - 1 hops of K/V forward; backward K/V again
    and the fp32 dK/dV that ride along home, as the unwindowed ring sends them."""

    @staticmethod
    def forward(ctx, q, k, v, positions, window):
        rank, n = dist.get_rank(), dist.get_world_size()
        scale = q.size(-1) ** -0.5
        comm = RingComm(None)
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"))
        held = (k.contiguous(), v.contiguous())
        for step in range(n):
            if step + 1 < n:
                incoming = tuple(comm.send_recv(t) for t in held)
                comm.commit()
            src = (rank - step) % n
            mask, empty = _band(positions[rank], positions[src], window, q.dtype)
            block_out, block_lse = kernels.attention_forward(
                q, held[0], held[1], False, scale, mask=mask
            )
            # A row the block hides whole has no lse (the kernel gives 0): it merges nothing.
            block_lse = block_lse.masked_fill(empty, float("-inf"))
            if step == 0:  # the own block: every row sees itself
                out.copy_(block_out)
                lse.copy_(block_lse)
            else:
                merge_block(out, lse, block_out, block_lse)
            if step + 1 < n:
                comm.wait()
                held = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (positions, window, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        positions, window, scale = ctx.args
        rank, n = dist.get_rank(), dist.get_world_size()
        kv_comm, grad_comm = RingComm(None), RingComm(None)
        dq = torch.zeros_like(q)
        dk_home, dv_home = torch.zeros_like(k), torch.zeros_like(v)
        held = (k.contiguous(), v.contiguous())
        travelling = (torch.zeros_like(k), torch.zeros_like(v))
        for step in range(n):
            src = (rank - step) % n
            if step + 1 < n:  # K/V fly while the block in hand computes
                incoming = tuple(kv_comm.send_recv(t) for t in held)
                kv_comm.commit()
            mask, _ = _band(positions[rank], positions[src], window, q.dtype)
            gq, gk, gv = kernels.attention_backward(
                grad, q, held[0], held[1], out, lse, False, scale, mask=mask
            )
            dq += gq
            target = (dk_home, dv_home) if step == 0 else travelling
            target[0].add_(gk)
            target[1].add_(gv)
            arriving = None
            if step >= 1:  # the dK/dV of the shard in hand go on with it, and home at the end
                arriving = tuple(grad_comm.send_recv(t) for t in travelling)
                grad_comm.commit()
                grad_comm.wait()
            if step + 1 < n:
                kv_comm.wait()
            if step + 1 < n:
                held = incoming
            if arriving is not None and step + 1 < n:
                travelling = arriving
            elif arriving is not None:
                dk_home += arriving[0]
                dv_home += arriving[1]
            elif step + 1 < n:
                travelling = (torch.zeros_like(k), torch.zeros_like(v))
        return dq, dk_home, dv_home, None, None


def _worker(rank, world_size, init_file, args, results):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    g = torch.Generator().manual_seed(0)
    shape_q = (1, args.heads, args.seq, args.head_dim)
    shape_kv = (1, args.kv_heads, args.seq, args.head_dim)
    full = [torch.randn(s, generator=g) for s in (shape_q, shape_kv, shape_kv, shape_q)]
    shards = [shard_sequence(t, None, 2, "zigzag") for t in full]
    positions = [shard_positions(args.seq, r, world_size, "zigzag") for r in range(world_size)]

    def window_aware():
        q, k, v = (t.detach().requires_grad_() for t in shards[:3])
        ring_attention(q, k, v, None, sharding="zigzag", window=args.window).backward(shards[3])
        return q.grad, k.grad, v.grad

    def masked_ring():
        q, k, v = (t.detach().requires_grad_() for t in shards[:3])
        MaskedRing.apply(q, k, v, positions, args.window).backward(shards[3])
        return q.grad, k.grad, v.grad

    variants = {"window-aware": window_aware, "full ring, masked": masked_ring}
    grads = {name: fn() for name, fn in variants.items()}  # warm-up, and the check below
    for a, b in zip(grads["window-aware"], grads["full ring, masked"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    times = {name: [] for name in variants}
    sent = {}
    for _ in range(args.reps):
        for name, fn in variants.items():
            before = commit_sizes()
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
            after = commit_sizes()
            sent[name] = sum(size * (count - before.get(size, 0)) for size, count in after.items())
    results.put((rank, {name: (statistics.median(t), sent[name]) for name, t in times.items()}))
    dist.destroy_process_group()


def _run_cp(cp: int, args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="window_bench_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, cp, init_file, args, results)) for r in range(cp)]
    for p in procs:
        p.start()
    per_rank = dict(results.get() for _ in procs)
    for p in procs:
        p.join()
    return {
        name: {
            "seconds": max(per_rank[r][name][0] for r in per_rank),
            "bytes_sent_busiest_rank": max(per_rank[r][name][1] for r in per_rank),
        }
        for name in per_rank[0]
    }


def _single_process(args) -> float:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.seq, args.head_dim, generator=g)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, generator=g) for _ in range(2))
    grad = torch.randn(q.shape, generator=g)
    times = []
    for _ in range(args.reps + 1):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        start = time.perf_counter()
        full_attention(*leaves, window=args.window).backward(grad)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    by_cp = {cp: _run_cp(cp, args) for cp in args.cp}
    single = _single_process(args)
    row_bytes = args.kv_heads * args.head_dim * 4
    print(
        f"S={args.seq} window={args.window} B=1 H={args.heads} Hkv={args.kv_heads} "
        f"D={args.head_dim} fp32, zigzag; fwd+bwd of one local layer, slowest rank, median of "
        f"{args.reps}; one process's local attention on the same tokens: {single:.3f} s\n"
    )
    print("| CP | variant | MB sent (busiest rank) | shards' worth | s | vs one process |")
    print("|---|---|---|---|---|---|")
    for cp, found in by_cp.items():
        shard_bytes = 2 * args.seq // cp * row_bytes  # one shard's K and V
        for name, figures in found.items():
            print(
                f"| {cp} | {name} | {figures['bytes_sent_busiest_rank'] / 1e6:.2f} | "
                f"{figures['bytes_sent_busiest_rank'] / shard_bytes:.2f} | "
                f"{figures['seconds']:.3f} | {figures['seconds'] / single:.2f}x |"
            )
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "command": "benchmarks/window_ring.py",
                    "args": {k: v for k, v in vars(args).items() if k != "out"},
                    "machine": platform.processor() or platform.machine(),
                    "torch": torch.__version__,
                    "single_process_seconds": single,
                    "by_cp": by_cp,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
