"""The chunked loss's memory and time on the CPU, against the loss it replaced.

Both run the same (tokens, h) input through a (vocab, h) head in chunks of LOSS_CHUNK_TOKENS:
"recomputed" is the loss before issue 18's chunked-loss part (each chunk under activation
checkpointing, fp32 logits and their cross-entropy, recomputed in backward); "chunked" is
`loss.chunked_cross_entropy` (each chunk's backward done in its forward, into a gradient of
the whole input allocated once). Peak: the allocator's own record (`memtrace.AllocatorTrace`)
over forward plus backward, minus the input and weight; time: best of `--repeats`.

    python benchmarks/chunked_loss_cpu.py --tokens 8192 --hidden 512 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ctxlaunch.perf.memory import LOSS_CHUNK_TOKENS
from ctxlaunch.runtime.modeling.loss import chunked_cross_entropy
from devkit.memtrace import AllocatorTrace


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def recomputed(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor: float
) -> torch.Tensor:
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS):
        rows = slice(start, start + LOSS_CHUNK_TOKENS)
        total = total + checkpoint(_chunk, hidden[rows], weight, targets[rows], use_reentrant=False)
    return total / divisor


def chunked(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor: float
) -> torch.Tensor:
    return chunked_cross_entropy(
        hidden, weight, targets, divisor=divisor, chunk_tokens=LOSS_CHUNK_TOKENS
    )


def measure(
    fn, tokens: int, hidden_size: int, vocab: int, autocast: bool, repeats: int
) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)

    def step() -> None:
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(hidden, weight, targets, float(tokens))
        loss.backward()

    step()  # warm
    hidden.grad = weight.grad = None
    with AllocatorTrace() as trace:
        step()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    # What the step leaves (the two gradients) is part of the peak; the inputs are not.
    return {"peak_bytes": trace.peak_bytes, "best_seconds": min(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32 and/or bf16 (autocast)")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    rows = []
    for autocast in [name == "bf16" for name in args.dtypes.split(",")]:
        for name, fn in (("recomputed", recomputed), ("chunked", chunked)):
            figures = measure(fn, args.tokens, args.hidden, args.vocab, autocast, args.repeats)
            rows.append({"loss": name, "dtype": "bf16 autocast" if autocast else "fp32", **figures})
            print(
                f"{rows[-1]['dtype']:<14} {name:<11} peak {figures['peak_bytes']:>13,} B  "
                f"best {figures['best_seconds'] * 1e3:8.1f} ms",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
