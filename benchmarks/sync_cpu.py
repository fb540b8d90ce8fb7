"""What one blocking exchange costs between compute steps of different lengths, when 2 or 4
one-thread processes share this machine's cores: the measurement the CPU self-check's
multi-rank misses call for (BENCHMARKS.md, step-time model: CPU self-check).

    .venv/bin/python benchmarks/sync_cpu.py [--ranks 2 4] [--sizes 192 384 768 1024 1536 2048]

For each rank count and square matmul size, `ctxlaunch.runtime.calibration.cpu.measure_sync` (the
calibration's own measurement, which uses 192): every rank computes one size x size product,
then sends to the next rank and receives from the previous; the best of two runs less the
best of two runs of the same products without the exchanges, per exchange. The iteration
count keeps each run near 0.8 s of one thread's compute (at an assumed 140 GFLOP/s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxlaunch.runtime.calibration.cpu import measure_sync  # noqa: E402

ASSUMED_FLOPS = 1.4e11
"""One thread's matmul rate, only to size the iteration counts (the run times what it gets)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[192, 384, 768, 1024, 1536, 2048])
    args = parser.parse_args()
    print(
        f"{'ranks':>5s} {'size':>5s} {'compute ms':>10s} {'iterations':>10s} "
        f"{'ms per exchange':>15s} {'wall s':>6s}",
        flush=True,
    )
    for ranks in args.ranks:
        for size in args.sizes:
            compute = 2 * size**3 / ASSUMED_FLOPS
            iterations = max(6, min(60, int(0.8 / compute)))
            start = time.monotonic()
            cost = measure_sync(ranks, iterations=iterations, size=size)
            print(
                f"{ranks:5d} {size:5d} {compute * 1e3:10.1f} {iterations:10d} "
                f"{cost * 1e3:15.2f} {time.monotonic() - start:6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
