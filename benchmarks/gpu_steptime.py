"""Issue 20's GPU check, prepared for a lent GPU machine: the bundled trainer's step predicted
by the step-time model (the default `ctxlaunch` profile) against the same step measured, at
several lengths, checkpointing modes and micro-batches, in one script (goal: within 10 %).

    python benchmarks/gpu_steptime.py --output gpu_steptime.json   # on the GPU (H200)
    python benchmarks/gpu_steptime.py --dry-run                    # the same code on a CPU

First it calibrates the GPU as `ctxlaunch calibrate SPEC --submit` does
(ctxlaunch.runtime.calibration.gpu: matmuls, the attention kernel, the trainer cut to 4 blocks
at 6K and 12K and to 1 block at 12K, 4 blocks at 24K held out). Each point is then the real
trainer (`python -m ctxlaunch.runtime.trainer`, via gpu_check.run_trainer) in its own process;
measured = the median step after the warm-up steps; predicted = `plan`'s step with that
calibration's profile and, beside it, with the committed `ctxlaunch` profile (alone with
--no-calibrate). The points use lengths the calibration did not run. Each point also records
the trainer's tokens/s, MFU and peak allocated memory against the planner's prediction. The
results so far are written after the calibration and after every point, and no point starts
past --budget-seconds, so a device lease that ends early still returns them.

Results: BENCHMARKS.md, step-time model: GPU calibration and held-out trainer layouts (raw
output in benchmarks/results/, gpu_steptime-*.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_check import planner_figures, run_trainer, trainer_spec, write_results  # noqa: E402

if TYPE_CHECKING:
    from ctxlaunch.perf.machine import GpuCalibration, Machine

# (seq_len, checkpointing, micro_batch): lengths the profile was not fitted on.
GPU_POINTS = [
    (12288, "none", 1),
    (24576, "selective", 1),
    (16384, "full", 2),
    (57344, "selective", 1),
    (36864, "none", 1),
    (65536, "full", 1),
    (20480, "selective", 2),
]
"""Run 2 (4 Dec 2026): none of run 1's points (8K none, 8K selective x2, 16K, 40K and 48K
selective, 32K none and full), which chose the loss term's place in the model."""
DRY_POINTS = [(512, "none", 1), (512, "selective", 2), (1024, "full", 1)]


def point(
    gpu: str,
    model: str,
    seq: int,
    mode: str,
    micro_batch: int,
    steps: int,
    warmup: int,
    workdir: Path,
    machine: Machine | None,
) -> dict:
    """One layout predicted and then measured. Beside the step: the committed `ctxlaunch`
    profile's prediction, the throughput and MFU the trainer reported, and its peak allocated
    memory against the planner's prediction (issue 18's figure, at no extra device time)."""
    from ctxlaunch.contract.hardware import gpu_info
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.steptime import predict_spec

    data = trainer_spec(model, seq, mode, steps + warmup, gpu, None)
    data["training"].update(micro_batch=micro_batch, global_batch=micro_batch)
    spec = validate_spec(data)
    committed = predict_spec(spec, machine_for(spec))
    predicted = predict_spec(spec, machine) if machine else committed
    out: dict = {
        "seq_len": seq,
        "checkpointing": mode,
        "micro_batch": micro_batch,
        "predicted_step_seconds": predicted.step_seconds,
        "predicted_committed_profile_step_seconds": committed.step_seconds,
        "predicted_terms": predicted.terms,
        "framework": predicted.framework,
        **planner_figures(data),
    }
    run = run_trainer(data, workdir / f"{seq}-{mode}-{micro_batch}", timeout=300)
    steps_seen = run.get("steps", [])
    timed = steps_seen[warmup:]
    out["exit_status"] = run["exit_status"]
    out["wall_s"] = run["wall_s"]
    if run["exit_status"] != 0 or not timed:
        out["log_tail"] = run["log_tail"]
        return out
    mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
    measured = statistics.median(s["step_seconds"] for s in timed)  # a hiccup moves no point
    peak = gpu_info(gpu).peak_bf16_flops
    allocated = max(s["peak_memory_bytes"] for s in steps_seen)
    out.update(
        measured_step_seconds=measured,
        measured_steps=[s["step_seconds"] for s in timed],
        error=predicted.step_seconds / measured - 1,
        error_committed_profile=committed.step_seconds / measured - 1,
        tokens_per_second=mean("tokens_per_second_per_gpu"),
        mfu_causal=mean("model_tflops_per_gpu_causal") * 1e12 / peak,
        mfu_full=mean("model_tflops_per_gpu_full") * 1e12 / peak,
        max_allocated_bytes=allocated,
        predicted_over_allocated=out["predicted_without_allowance_bytes"] / allocated,
    )
    return out


def calibrate(model: str, dry: bool) -> GpuCalibration:
    """The H200 calibration the points are predicted with (ctxlaunch.runtime.calibration.gpu,
    as `ctxlaunch calibrate SPEC --submit` runs it): on one GPU, at lengths none of the points
    use; with `dry` its GPU code path on this CPU."""
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.runtime.calibration.gpu import measure_device

    data = trainer_spec(model, 8192, "selective", 1, "H200", None)
    return measure_device(
        validate_spec(data), dry_run=dry, log=lambda line: print(line, flush=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny model, toy sizes")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="predict with the committed profile instead of calibrating first",
    )
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=480,
        help="start no trainer point after this many seconds (the results so "
        "far are written after every point)",
    )
    args = parser.parse_args()
    dry = args.dry_run
    gpu, model = ("cpu", "tiny") if dry else ("H200", "llama3.2-1b")
    points = DRY_POINTS if dry else GPU_POINTS
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dry_run": dry,
        "points": [],
    }
    start = time.perf_counter()
    machine = None
    if not args.no_calibrate:
        calibration = calibrate(model if not dry else "tiny", dry)
        results["calibration"] = dataclasses.asdict(calibration)
        results["calibration_seconds"] = round(time.perf_counter() - start, 1)
        machine = calibration.machine(gpus_per_node=1)
        write_results(results, args.output, dry)
    with tempfile.TemporaryDirectory() as tmp:
        for seq, mode, mb in points:
            if time.perf_counter() - start > args.budget_seconds:
                results["points"].append(
                    {
                        "seq_len": seq,
                        "checkpointing": mode,
                        "micro_batch": mb,
                        "skipped": "over the budget",
                    }
                )
                continue
            try:
                timed = 2 if dry else (6 if seq <= 16384 else 3)  # short steps: more of them
                row = point(gpu, model, seq, mode, mb, timed, 1 if dry else 2, Path(tmp), machine)
            except Exception as exc:  # one failed point must not cost the others' device time
                row = {
                    "seq_len": seq,
                    "checkpointing": mode,
                    "micro_batch": mb,
                    "error_text": repr(exc),
                }
            row["elapsed_s"] = round(time.perf_counter() - start, 1)
            results["points"].append(row)
            write_results(results, args.output, dry)
            print(
                json.dumps(
                    {
                        k: v
                        for k, v in row.items()
                        if k not in ("predicted_terms", "predicted_parts_bytes")
                    },
                    default=str,
                )[:1500],
                flush=True,
            )
    errors = [abs(r["error"]) for r in results["points"] if "error" in r]
    results["within_10_percent"] = sum(e <= 0.10 for e in errors)
    results["timed_points"] = len(errors)
    results["worst_error"] = max(errors) if errors else None
    write_results(results, args.output, dry)
    print(
        f"gpu_steptime: {results['within_10_percent']} of {results['timed_points']} points "
        f"within 10 %, worst {results['worst_error']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
