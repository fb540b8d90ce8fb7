"""The trainer's CPU attention kernel by length, causality and thread count: what the CPU
self-check's attention constants should be measured on (BENCHMARKS.md, step-time model: CPU
self-check).

    nice -n 19 .venv/bin/python benchmarks/attention_threads_cpu.py [--lengths 2048 3072 6144]

For each length and thread count (1 and every core), the best of `--repeats` forward +
backward calls through `ctxlaunch.cp.kernels` at tiny-mha's head shape (4 heads of 32, fp32),
on a full block and on a causal one, as FLOP/s of the modelled work (12 x head_dim FLOPs per
score entry; a causal call over s tokens counted as s^2/2 entries per head, so its rate
includes the diagonal's waste). Prints the thread scaling (all cores / one thread) of each.
The default lengths are ones the self-check's sweep (4K, 8K, 16K) never runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _forward_backward(q, k, v, causal: bool, scale: float) -> None:  # type: ignore[no-untyped-def]
    import torch

    from ctxlaunch.cp.kernels import attention_backward, attention_forward

    out, lse = attention_forward(q, k, v, causal, scale)
    attention_backward(torch.ones_like(out), q, k, v, out, lse, causal, scale)


def main() -> None:
    import torch

    from ctxlaunch.runtime.calibration.measuring import best_seconds

    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 3072, 6144])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    heads, head_dim, cores = 4, 32, os.cpu_count() or 1
    print(f"load average before: {os.getloadavg()}", flush=True)
    rows = []
    for seq in args.lengths:
        q = torch.randn(1, heads, seq, head_dim)
        k, v = torch.randn_like(q), torch.randn_like(q)
        scale = head_dim**-0.5
        for causal in (False, True):
            call = functools.partial(_forward_backward, q, k, v, causal, scale)
            entries = heads * seq * seq / (2 if causal else 1)
            rates = {}
            for threads in (1, cores):
                torch.set_num_threads(threads)
                rates[threads] = 12.0 * head_dim * entries / best_seconds(call, args.repeats)
            row = {
                "seq": seq,
                "causal": causal,
                "gflops_one_thread": rates[1] / 1e9,
                "gflops_all_cores": rates[cores] / 1e9,
                "scaling": rates[cores] / rates[1],
            }
            rows.append(row)
            print(
                f"{seq:6d} {'causal' if causal else 'full  '}  1 thread {rates[1] / 1e9:6.1f}"
                f"  {cores} threads {rates[cores] / 1e9:6.1f} GFLOP/s  scaling "
                f"{row['scaling']:.2f}",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "cores": cores}, indent=1))


if __name__ == "__main__":
    main()
