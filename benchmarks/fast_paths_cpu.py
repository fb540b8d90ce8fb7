"""The trainer's step time on this CPU with each fast path on and off.

    .venv/bin/python benchmarks/fast_paths_cpu.py [--preset tiny] [--seq-len 1024] [--steps 6]

One process, the real trainer (`Trainer.train_step`), fp32, ZeRO-0, no checkpointing, for each
of training.compile false/true x training.fused_optimizer false/true; prints the best step
after the first two (compilation and warm-up happen there; other engineers load this machine,
and the best of several steps is the least disturbed) and the first step's seconds (which hold
the compile time). On the CPU the attention and matmuls dominate; these figures say what the
switches cost or save here, not what they do on a GPU (to be measured by gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxlaunch.contract.loader import validate_spec  # noqa: E402
from ctxlaunch.runtime.modeling import pointwise  # noqa: E402
from ctxlaunch.runtime.parallel.context import build_context  # noqa: E402
from ctxlaunch.runtime.trainer.loop import Trainer  # noqa: E402


def measure(preset: str, seq_len: int, steps: int, compile_: bool, fused: bool) -> dict:
    spec = validate_spec(
        {
            "name": "fast-paths",
            "model": {"preset": preset, "dtype": "fp32"},
            "training": {
                "seq_len": seq_len,
                "global_batch": 1,
                "steps": steps,
                "compile": compile_,
                "fused_optimizer": fused,
            },
            "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
        }
    )
    ctx = build_context(spec.parallel_dims, rank=0)
    trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    try:
        seconds = [trainer.train_step().step_seconds for _ in range(steps)]
    finally:
        pointwise.set_compiled(False)
    return {
        "compile": compile_,
        "fused_optimizer": fused,
        "first_step_seconds": seconds[0],
        "best_step_seconds": min(seconds[2:] or seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = [
        measure(args.preset, args.seq_len, args.steps, c, f)
        for c in (False, True)
        for f in (False, True)
    ]
    for row in rows:
        print(
            f"compile {'on ' if row['compile'] else 'off'}  AdamW "
            f"{'fused  ' if row['fused_optimizer'] else 'foreach'}  best step "
            f"{row['best_step_seconds'] * 1e3:8.1f} ms  first step "
            f"{row['first_step_seconds']:6.1f} s"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
