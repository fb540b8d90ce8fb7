"""Activation memory per rank of one transformer block at CP 1, 2 and 4, measured with
saved-tensor hooks, against the planner's prediction.

    .venv/bin/python benchmarks/activation_memory.py [--seq 16384] [--hidden 1024]

Launches itself under torchrun (gloo, CPU) for each CP degree; each rank builds the trainer's
block, runs its forward on its zigzag shard with ring attention, and counts the unique storages
autograd saved for backward (parameters and the shared RoPE tables excluded). Deterministic:
bytes, not time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ctxlaunch.contract.parallel_dims import ParallelDims
    from ctxlaunch.contract.spec import ModelSpec
    from ctxlaunch.cp import ring_attention, shard_positions
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.memory import block_activation_bytes_per_token
    from ctxlaunch.runtime.modeling.model import Block, rope_tables
    from devkit.memtrace import SavedTensorMeter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heads, kv_heads = args.hidden // 64, args.hidden // 256
    spec_model = ModelSpec(
        layers=1, hidden=args.hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=args.ffn, vocab=256
    )
    results = []
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for mode in ("none", "selective", "full"):
            block = Block(args.hidden, heads, kv_heads, args.ffn, 1e-5).to(dtype)
            block.checkpointing = mode
            if world > 1:
                block.attn.attend = lambda q, k, v: ring_attention(
                    q, k, v, causal=True, sharding="zigzag"
                )
            tokens = args.seq // world
            positions = shard_positions(args.seq, rank, world, "zigzag")
            cos, sin = rope_tables(positions, args.hidden // heads, 10000.0, dtype)
            x = torch.randn(1, tokens, args.hidden, dtype=dtype, requires_grad=True)
            with SavedTensorMeter(exclude=[*block.parameters(), cos, sin]) as meter:
                y = block(x, cos, sin)
            y.float().sum().backward()
            # bf16 here is the DeepSpeed path (bf16 module, bf16 residual): zero_stage 2.
            layout = Layout(
                seq_len=args.seq,
                dtype=dtype_name,
                zero_stage=0 if dtype_name == "fp32" else 2,
                activation_checkpointing=mode,
                dims=ParallelDims(cp=world),
            )
            predicted = block_activation_bytes_per_token(spec_model, layout) * tokens
            results.append(
                {
                    "dtype": dtype_name,
                    "checkpointing": mode,
                    "cp": world,
                    "rank": rank,
                    "measured_bytes": meter.bytes,
                    "predicted_bytes": int(predicted),
                }
            )
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.output, "w") as handle:
            json.dump([r for per_rank in gathered for r in per_rank], handle)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for cp in (1, 2, 4):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={cp}",
                    __file__,
                    "--worker",
                    "--output",
                    out.name,
                    "--seq",
                    str(args.seq),
                    "--hidden",
                    str(args.hidden),
                    "--ffn",
                    str(args.ffn),
                ],
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            rows += json.load(open(out.name))
    print(
        f"one block: hidden {args.hidden}, heads {args.hidden // 64}, kv_heads "
        f"{args.hidden // 256}, ffn {args.ffn}, total sequence {args.seq}, ring zigzag"
    )
    print(
        "| dtype | checkpointing | CP | MiB per rank (max over ranks) | / CP 1 | goal 1.15/N | "
        "planner MiB | planner / measured |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype in ("fp32", "bf16"):
        for mode in ("none", "selective", "full"):
            base = max(
                r["measured_bytes"]
                for r in rows
                if (r["dtype"], r["checkpointing"], r["cp"]) == (dtype, mode, 1)
            )
            for cp in (1, 2, 4):
                mine = [
                    r
                    for r in rows
                    if (r["dtype"], r["checkpointing"], r["cp"]) == (dtype, mode, cp)
                ]
                measured = max(r["measured_bytes"] for r in mine)
                predicted = max(r["predicted_bytes"] for r in mine)
                print(
                    f"| {dtype} | {mode} | {cp} | {measured / 2**20:.2f} | "
                    f"{measured / base:.3f} | {1.15 / cp:.3f} | {predicted / 2**20:.2f} | "
                    f"{predicted / measured:.3f} |"
                )


if __name__ == "__main__":
    main()
