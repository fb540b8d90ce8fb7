"""The checks only a GPU can answer, as one short script for a lent GPU machine.

    python benchmarks/gpu_check.py                 # on the GPU: both checks, JSON + table
    python benchmarks/gpu_check.py --device cpu --seq 1024 --small   # a dry run of the script

1. Trainer step MFU: one GPU trains a ~1B Llama-style model (llama3.2-1b's shape) at 16K tokens
   in bf16 through the real Trainer (ZeRO-0, autocast, selective checkpointing), a few warm-up
   steps then timed steps; MFU in both conventions against the GPU table's dense BF16 peak.
   Goal: >= 45 %.
2. Ring schedule efficiency: the causal attention of one 16K sequence computed the way an
   8-rank zigzag ring computes it (every rank's blocks, merged through the log-sum-exp, forward
   and backward, in one process) against one flash call over the whole sequence. Goal: >= 90 %.

Not run on this project's CPU machines (no GPU); results go to BENCHMARKS.md with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def trainer_mfu(device: str, seq: int, steps: int, small: bool) -> dict:
    import torch
    import torch.distributed as dist

    from ctxlaunch.loader import validate_spec
    from ctxlaunch.trainer.loop import Trainer
    from ctxlaunch.trainer.parallelize import build_context

    gpu = "H200" if device == "cuda" else "cpu"
    model = {"preset": "tiny", "dtype": "bf16"} if small else {"preset": "llama3.2-1b",
                                                               "dtype": "bf16"}
    spec = validate_spec({
        "name": "gpu-check", "model": model,
        "training": {"seq_len": seq, "steps": steps + 3, "activation_checkpointing": "selective",
                     "zero_stage": 0},
        "cluster": {"target": "local", "gpu": gpu, "gpus_per_node": 1}})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    torch_device = torch.device(device)
    ctx = build_context(rank=0, world_size=1, dp=1, cp=1, ulysses=1, layout="zigzag")
    trainer = Trainer(spec, ctx, torch_device, log=lambda _: None)
    for _ in range(3):
        trainer.train_step()
    timed = [trainer.train_step() for _ in range(steps)]
    dist.destroy_process_group()
    tokens = sum(m.tokens_per_second_per_gpu for m in timed) / len(timed)
    peak = spec.cluster.gpu_info.peak_bf16_flops
    return {
        "model": model["preset"], "seq_len": seq, "tokens_per_second": tokens,
        "mfu_full": sum(m.model_tflops_per_gpu_full for m in timed) / len(timed) * 1e12 / peak,
        "mfu_causal": sum(m.model_tflops_per_gpu_causal for m in timed) / len(timed) * 1e12
        / peak,
        "peak_memory_gib": max(m.peak_memory_bytes for m in timed) / 2**30,
    }


def ring_schedule_efficiency(device: str, seq: int, ranks: int, heads: int, head_dim: int,
                             repeats: int) -> dict:
    import torch

    from ctxlaunch.cp import kernels
    from ctxlaunch.cp.layout import shard_for_rank
    from ctxlaunch.cp.merge import merge_block
    from ctxlaunch.cp.ring import _block

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)
               for _ in range(3))
    grad = torch.randn_like(q)
    scale = head_dim ** -0.5
    shards = [tuple(shard_for_rank(t, r, ranks, 2, "zigzag") for t in (q, k, v, grad))
              for r in range(ranks)]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def full() -> None:
        out, lse = kernels.attention_forward(q, k, v, True, scale)
        kernels.attention_backward(grad, q, k, v, out, lse, True, scale)

    def ring() -> None:
        for rank in range(ranks):
            q_r, _, _, g_r = shards[rank]
            out = lse = None
            blocks = []
            for step in range(ranks):
                src = (rank - step) % ranks
                block = _block(rank, src, True, "zigzag", q_r.size(2))
                if block is None:
                    continue
                rows, kv_rows, causal = block
                _, k_s, v_s, _ = shards[src]
                blocks.append((rows, k_s[:, :, kv_rows], v_s[:, :, kv_rows], causal))
                b_out, b_lse = kernels.attention_forward(q_r[:, :, rows], k_s[:, :, kv_rows],
                                                         v_s[:, :, kv_rows], causal, scale)
                if out is None:
                    out, lse = b_out.float(), b_lse
                else:
                    merge_block(out[:, :, rows], lse[:, :, rows], b_out, b_lse)
            final = out.to(dtype)
            for rows, k_b, v_b, causal in blocks:
                kernels.attention_backward(g_r[:, :, rows], q_r[:, :, rows], k_b, v_b,
                                           final[:, :, rows], lse[:, :, rows], causal, scale)

    def timed(fn) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - start)
        return best

    t_full, t_ring = timed(full), timed(ring)
    return {"seq_len": seq, "ranks": ranks, "heads": heads, "head_dim": head_dim,
            "dtype": str(dtype), "one_flash_call_s": t_full, "ring_blocks_s": t_ring,
            "efficiency": t_full / t_ring}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny model and heads (dry run)")
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args()
    results = {
        "ring_schedule": ring_schedule_efficiency(
            args.device, args.seq, 8, 4 if args.small else 32, 32 if args.small else 128, 5),
        "trainer": trainer_mfu(args.device, args.seq, args.steps, args.small),
    }
    if args.device == "cuda":
        import torch

        results["device"] = torch.cuda.get_device_name()
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
