"""Issue 20's GPU check, prepared for a lent GPU machine: the bundled trainer's step predicted
by the step-time model (the default `ctxlaunch` profile) against the same step measured, at
several lengths, checkpointing modes and micro-batches, in one script (goal: within 10 %).

    python benchmarks/gpu_steptime.py --output gpu_steptime.json   # on the GPU (H200)
    python benchmarks/gpu_steptime.py --dry-run                    # the same code on a CPU

First it calibrates the GPU as `ctxlaunch calibrate SPEC --submit` does
(ctxlaunch.runtime.calibrate_device: matmuls, the attention kernel, the trainer at 6K and 12K,
24K held out). Each point is then the real trainer (`python -m ctxlaunch.trainer`, via
gpu_check.run_trainer) in its own process; measured = the mean step after the warm-up steps;
predicted = `plan`'s step with that calibration's profile (with --no-calibrate: the committed
`ctxlaunch` profile, from section 0's 16K and 64K). The points use lengths the calibration did
not run. Not yet run on a GPU: no device was lent to the sessions that wrote it (issue 20).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_check import run_trainer, trainer_spec, write_results  # noqa: E402

if TYPE_CHECKING:
    from ctxlaunch.perf.machine import GpuCalibration, Machine

# (seq_len, checkpointing, micro_batch): lengths the profile was not fitted on.
GPU_POINTS = [(8192, "none", 1), (8192, "selective", 2), (40960, "selective", 1),
              (32768, "none", 1), (32768, "full", 1), (49152, "selective", 1)]
DRY_POINTS = [(512, "none", 1), (512, "selective", 2), (1024, "full", 1)]


def point(gpu: str, model: str, seq: int, mode: str, micro_batch: int, steps: int, warmup: int,
          workdir: Path, machine: Machine | None) -> dict:
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.steptime import predict_spec

    data = trainer_spec(model, seq, mode, steps + warmup, gpu, None)
    data["training"].update(micro_batch=micro_batch, global_batch=micro_batch)
    spec = validate_spec(data)
    predicted = predict_spec(spec, machine or machine_for(spec))
    out: dict = {"seq_len": seq, "checkpointing": mode, "micro_batch": micro_batch,
                 "predicted_step_seconds": predicted.step_seconds,
                 "predicted_terms": predicted.terms, "framework": predicted.framework}
    run = run_trainer(data, workdir / f"{seq}-{mode}-{micro_batch}", timeout=540)
    timed = run.get("steps", [])[warmup:]
    out["exit_status"] = run["exit_status"]
    if run["exit_status"] != 0 or not timed:
        out["log_tail"] = run["log_tail"]
        return out
    measured = sum(s["step_seconds"] for s in timed) / len(timed)
    out.update(measured_step_seconds=measured,
               error=predicted.step_seconds / measured - 1)
    return out


def calibrate(model: str, dry: bool) -> GpuCalibration:
    """The H200 calibration the points are predicted with (ctxlaunch.runtime.calibrate_device,
    as `ctxlaunch calibrate SPEC --submit` runs it): on one GPU, at lengths none of the points
    use; with `dry` its GPU code path on this CPU."""
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.runtime.calibrate_device import measure_device

    data = trainer_spec(model, 8192, "selective", 1, "H200", None)
    return measure_device(validate_spec(data), dry_run=dry,
                          log=lambda line: print(line, flush=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny model, toy sizes")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="predict with the committed profile instead of calibrating first")
    args = parser.parse_args()
    dry = args.dry_run
    gpu, model = ("cpu", "tiny") if dry else ("H200", "llama3.2-1b")
    points = DRY_POINTS if dry else GPU_POINTS
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": dry,
                     "points": []}
    machine = None
    if not args.no_calibrate:
        calibration = calibrate(model if not dry else "tiny", dry)
        results["calibration"] = dataclasses.asdict(calibration)
        machine = calibration.machine(gpus_per_node=1)
    with tempfile.TemporaryDirectory() as tmp:
        for seq, mode, mb in points:
            try:
                row = point(gpu, model, seq, mode, mb, 2 if dry else 3, 1 if dry else 2,
                            Path(tmp), machine)
            except Exception as exc:  # one failed point must not cost the others' device time
                row = {"seq_len": seq, "checkpointing": mode, "micro_batch": mb,
                       "error_text": repr(exc)}
            results["points"].append(row)
            print(json.dumps(row, default=str)[:1500], flush=True)
    errors = [abs(r["error"]) for r in results["points"] if "error" in r]
    results["within_10_percent"] = sum(e <= 0.10 for e in errors)
    results["timed_points"] = len(errors)
    results["worst_error"] = max(errors) if errors else None
    write_results(results, args.output, dry)
    print(f"gpu_steptime: {results['within_10_percent']} of {results['timed_points']} points "
          f"within 10 %, worst {results['worst_error']}", flush=True)


if __name__ == "__main__":
    main()
