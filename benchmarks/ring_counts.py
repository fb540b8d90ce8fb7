# Shapes: q (1, Hq, S, D), k, v (1, Hkv, S, D) meta tensors; 8-rank zigzag schedule, bf16.
"""Count what the ring's block schedule issues on CUDA without a GPU: kernel launches besides
the attention calls, and the bytes those other launches move.

    python benchmarks/ring_counts.py [--root CHECKOUT] [--seq 16384 65536]

The schedule of `benchmarks/gpu_check.py` (BENCHMARKS.md, GPU runs on the H200) runs on ``meta``
tensors, which send `ctxlaunch.cp.kernels` down its CUDA code path (only the CPU is
special-cased) and run torch's own shape functions of every op, flash included. The counting is
`devkit/launches.Counter` (a TorchDispatchMode over the aten calls). Ops inside
`merge.merge_block` are counted apart, and for the compiled merge CUDA runs (this checkout's
default) Inductor's own count of kernels and bytes for the same call is
measured by compiling it on the CPU. ``--root`` runs another checkout's schedule (e.g. main,
before this change); there the timed region included the sharding, so it is counted too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path

import torch

from devkit.launches import Counter, nbytes


@contextlib.contextmanager
def counted_merges(counter: Counter, merge_module):
    """Tag the ops of every `merge_block` call as ``merge`` and count the calls and shapes."""
    original = merge_module.merge_block
    shapes: dict[tuple, int] = {}

    def tagged(out, lse, block_out, block_lse, *rest):
        shapes[(tuple(out.shape), tuple(out.stride()), str(block_out.dtype))] = (
            shapes.get((tuple(out.shape), tuple(out.stride()), str(block_out.dtype)), 0) + 1
        )
        counter.section = "merge"
        try:
            return original(out, lse, block_out, block_lse, *rest)
        finally:
            counter.section = "other"

    merge_module.merge_block = tagged
    try:
        yield shapes
    finally:
        merge_module.merge_block = original


def inductor_merge(shape, stride, dtype_name) -> dict:
    """What Inductor generates for one compiled merge of this shape (its CPU backend: one fused
    C++ function per call, whose loop nests are counted), and the bytes that one pass must move:
    out and lse read and written, block_out and block_lse read (a formula, not a measurement)."""
    from torch._inductor import metrics

    from ctxlaunch.cp.merge import merge_math

    dtype = getattr(torch, dtype_name.split(".")[-1])
    full_rows = stride[1] // shape[3]  # the shard's rows that the view strides over
    out = torch.randn(shape[0], shape[1], full_rows, shape[3])[:, :, full_rows - shape[2] :]
    lse = torch.randn(shape[0], shape[1], full_rows)[:, :, full_rows - shape[2] :]
    block_out = torch.randn(shape).to(dtype)
    block_lse = torch.randn(shape[:3])
    torch._dynamo.reset()
    metrics.reset()
    torch.compile(merge_math, fullgraph=True)(out, lse, block_out, block_lse)
    moved = 2 * nbytes(out) + 2 * nbytes(lse) + nbytes(block_out) + nbytes(block_lse)
    return {"loop_nests": metrics.generated_kernel_count, "bytes_formula": moved}


def count(seq: int, ranks: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    gpu_check = importlib.import_module("benchmarks.gpu_check")
    merge_module = importlib.import_module("ctxlaunch.cp.merge")
    dev, dtype = "meta", torch.bfloat16
    q = torch.empty(1, heads, seq, head_dim, device=dev, dtype=dtype)
    k, v = (torch.empty(1, kv_heads, seq, head_dim, device=dev, dtype=dtype) for _ in range(2))
    grad = torch.empty_like(q)
    scale = head_dim**-0.5
    counter = Counter()
    staged = hasattr(gpu_check, "RingRun")
    if staged:  # sharding and buffers outside the timed region, as the benchmark now times it
        run = gpu_check.RingRun(
            gpu_check.stage_ring(q, k, v, grad, ranks, "zigzag"), ranks, True, scale, "zigzag"
        )
        with counted_merges(counter, merge_module) as shapes, counter:
            run.run()
    else:
        with counted_merges(counter, merge_module) as shapes, counter:
            gpu_check.ring_schedule(q, k, v, grad, ranks, True, "zigzag", scale)
    result = {
        "seq_len": seq,
        "ranks": ranks,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "staged": staged,
        "counts": counter.counts,
        "merge_calls": sum(shapes.values()),
    }
    if staged and hasattr(merge_module, "merge_math"):
        fused = {"loop_nests": 0, "bytes_formula": 0}
        for (shape, stride, dtype_name), calls in shapes.items():
            one = inductor_merge(shape, stride, dtype_name)
            for key in fused:
                fused[key] += calls * one[key]
        result["compiled_merge"] = fused
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        default=str(Path(__file__).resolve().parent.parent),
        help="the checkout whose ctxlaunch and benchmarks/gpu_check.py to count",
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    rows = [count(seq, args.ranks, 32, 8, 128) for seq in args.seq]
    print(json.dumps(rows, indent=1))
    print(
        "\n| S | attention calls | other launches | other GB | of which merge launches | merge GB "
        "| compiled merge: CPU loop nests | GB (formula) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r["counts"]
        att, merge, other = (
            c.get(n, {"launches": 0, "bytes": 0}) for n in ("attention", "merge", "other")
        )
        fused = r.get("compiled_merge")
        fused_cells = (
            f"{fused['loop_nests']} | {fused['bytes_formula'] / 1e9:.2f}" if fused else "- | -"
        )
        print(
            f"| {r['seq_len']} | {att['launches']} | {other['launches'] + merge['launches']} | "
            f"{(other['bytes'] + merge['bytes']) / 1e9:.2f} | {merge['launches']} | "
            f"{merge['bytes'] / 1e9:.2f} | {fused_cells} |"
        )


if __name__ == "__main__":
    main()
