"""The step-time model against the trainer's measured step time on this CPU.

    .venv/bin/python benchmarks/steptime_cpu.py [--lengths 4096 8192 16384] [--steps 3]

1. Calibrates (`ctxlaunch.runtime.calibration.cpu.measure`: matmul on the model's projections, attention
   through the trainer's kernels, memory copy, the model's elementwise rate and fixed cost from
   its step at 256 and 1,024 tokens, gloo loopback) at the model's shape and saves the constants where `advise` and
   `report` read them ($CTXLAUNCH_HOME/cpu_calibration.json).
2. Runs the trainer as a local sweep over CP 1/2/4 x ring/Ulysses/hybrid, TP 2 and PP 2, x the
   lengths (one process per rank, the machine's cores shared as the local target shares them), so
   `ctxlaunch report SWEEP_ID --plots DIR` draws it afterwards.
3. Prints, per point, the measured step time (the best step after the first: other engineers
   load this machine, and the best of several steps is the least disturbed; the calibration is
   a best-of too), the predicted one and the error, the largest error, and the Spearman rank correlation of
   predicted and measured tokens/s/GPU over the points.

The model is tiny-mha (h 128, 4 heads, 4 K/V heads so Ulysses 4 is legal, 2 layers), fp32,
ZeRO-0: attention dominates, as at long context on GPUs. Wall-clock times on a shared machine
are noisy; BENCHMARKS.md records the load next to each run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxlaunch.contract.loader import apply_overrides, validate_spec  # noqa: E402
from ctxlaunch.launch.report import build_report  # noqa: E402
from ctxlaunch.launch.sweep import Point, prepare, submit, triage  # noqa: E402
from ctxlaunch.perf.machine import save_calibration  # noqa: E402
from ctxlaunch.runtime.calibration.cpu import ATTENTION_SEQ, measure  # noqa: E402

# (name, overrides): CP 1/2/4 x ring/Ulysses/hybrid, and TP 2 and PP 2 (two micro-batches
# through the two stages: 1F1B needs one per stage) on their own.
LAYOUTS = [
    ("cp1-ring", {"parallel.cp": 1}),
    ("cp2-ring", {"parallel.cp": 2}),
    ("cp2-ulysses", {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"}),
    ("cp4-ring", {"parallel.cp": 4}),
    ("cp4-ulysses", {"parallel.cp": 4, "parallel.cp_algorithm": "ulysses"}),
    (
        "cp4-hybrid",
        {"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_degree": 2},
    ),
    ("tp2", {"parallel.tp": 2}),
    ("pp2", {"parallel.pp": 2, "training.global_batch": 2}),
]
AXES = ["training.seq_len", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.cp_algorithm"]


def base_spec(steps: int) -> dict:
    return {
        "name": "steptime-cpu",
        "model": {"preset": "tiny-mha", "dtype": "fp32"},
        "training": {
            "seq_len": 4096,
            "micro_batch": 1,
            "steps": steps,
            "log_interval": 1,
            "zero_stage": 0,
            "seed": 7,
            "data": {"source": "synthetic"},
        },
        "parallel": {"cp": 1, "cp_algorithm": "ring", "layout": "zigzag"},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }


def points(lengths: list[int], steps: int) -> list[Point]:
    out = []
    for seq in lengths:
        for tag, changes in LAYOUTS:
            name = f"steptime-cpu-{seq // 1024}k-{tag}"
            ranks = (
                changes.get("parallel.cp", 1)
                * changes.get("parallel.tp", 1)
                * changes.get("parallel.pp", 1)
            )
            overrides = [
                f"name={name}",
                f"training.seq_len={seq}",
                f"cluster.gpus_per_node={ranks}",
                *(f"{path}={value}" for path, value in changes.items()),
            ]
            spec = validate_spec(apply_overrides(base_spec(steps), overrides), name)
            p = spec.parallel
            out.append(
                Point(
                    len(out),
                    {
                        "training.seq_len": seq,
                        "parallel.tp": p.tp,
                        "parallel.pp": p.pp,
                        "parallel.cp": p.cp,
                        "parallel.cp_algorithm": p.cp_algorithm,
                    },
                    name,
                    spec,
                )
            )
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="run the sweep this many times (alternating order); best step",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--attention-seq",
        type=int,
        default=ATTENTION_SEQ,
        help="calibrate the attention rate and causal tile on a block this "
        f"long (default {ATTENTION_SEQ:,}, as `ctxlaunch calibrate`: a "
        "length no sweep point runs; BENCHMARKS.md, step-time model: CPU self-check)",
    )
    parser.add_argument(
        "--attention-ramp",
        type=int,
        nargs=2,
        default=None,
        metavar=("SHORT", "LONG"),
        help="fit the attention rate and a length ramp on two blocks (e.g. "
        "1536 6144, lengths no sweep call runs)",
    )
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()}", flush=True)
    from ctxlaunch.contract.spec import ModelSpec

    calibration = measure(
        heads=4,
        head_dim=32,
        dtype="fp32",
        model=ModelSpec(preset="tiny-mha", dtype="fp32"),
        attention_seq=None if args.attention_ramp else args.attention_seq,
        attention_ramp_seqs=tuple(args.attention_ramp) if args.attention_ramp else None,
    )
    print(f"calibration: {calibration}", flush=True)
    print(f"saved {save_calibration(calibration)}", flush=True)

    from ctxlaunch.launch import jobstore

    all_points = points(args.lengths, args.steps)
    runnable, reasons = triage(all_points)
    assert not reasons, reasons
    best: dict[int, list[dict]] = {}
    for repeat in range(args.repeats):
        # Alternate the order, so a burst of load from elsewhere hits different points.
        order = runnable if repeat % 2 == 0 else runnable[::-1]
        submission = prepare("steptime-cpu", order)
        log = io.StringIO()
        with redirect_stdout(log), redirect_stderr(log):
            sweep_id = submit(
                "steptime-cpu", AXES, all_points, reasons, submission, log=lambda text: None
            )
        print(f"sweep {sweep_id}; load average after: {os.getloadavg()}", flush=True)
        sweep = jobstore.load_sweep(sweep_id)
        for entry in sweep["points"]:
            metrics = jobstore.run_dir(jobstore.load(entry["job"])) / "metrics.jsonl"
            steps = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
            best.setdefault(entry["index"], []).extend(steps)

    report = build_report(sweep, calibration)
    for row, entry in zip(report.rows, sweep["points"]):
        steps = best[entry["index"]]
        row["mean_step_seconds"] = sum(m["step_seconds"] for m in steps) / len(steps)
        row["step_seconds"] = min(m["step_seconds"] for m in steps)
        row["tokens_per_second_per_gpu"] = max(m["tokens_per_second_per_gpu"] for m in steps)
        row["step_error"] = row["predicted_step_seconds"] / row["step_seconds"] - 1
    rows = [r for r in report.rows if r.get("step_seconds")]
    print(f"{'point':34s} {'mean s':>7s} {'best s':>7s} {'predicted s':>11s} {'error':>7s}")
    for r in report.rows:
        measured = r.get("step_seconds")
        print(
            f"{r['name']:34s} {r['mean_step_seconds']:7.3f} {measured or float('nan'):7.3f} "
            f"{r['predicted_step_seconds']:11.3f} "
            f"{(r['step_error'] if measured else float('nan')):+7.1%}  {r['state']}"
        )
    worst = max(abs(r["step_error"]) for r in rows)
    rho = spearman(
        [r["tokens_per_second_per_gpu"] for r in rows],
        [r["predicted_tokens_per_second_per_gpu"] for r in rows],
    )
    print(f"largest |error| {worst:.1%}; Spearman (tokens/s/GPU) {rho:.3f} over {len(rows)} points")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "sweep": sweep_id,
                    "calibration": calibration.__dict__,
                    "rows": report.rows,
                    "spearman": rho,
                },
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
