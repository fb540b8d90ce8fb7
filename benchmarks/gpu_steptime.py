"""Issue 20's GPU check, prepared for a lent GPU machine: the bundled trainer's step predicted
by the step-time model (the default `ctxlaunch` profile) against the same step measured, at
several lengths, checkpointing modes and micro-batches, in one script (goal: within 10 %).

    python benchmarks/gpu_steptime.py --output gpu_steptime.json   # on the GPU (H200)
    python benchmarks/gpu_steptime.py --dry-run                    # the same code on a CPU

Each point is the real trainer (`python -m ctxlaunch.trainer`, via gpu_check.run_trainer) in its
own process; measured = the mean step after the warm-up steps; predicted = `plan`'s step
(`machine_for(spec)`: on the GPU the committed profile, whose constants came from other lengths
(16K and 64K, BENCHMARKS.md section 0); on the CPU the saved calibration). The points use
lengths that profile was not fitted on. Not yet run on a GPU: no device was lent to the
session that wrote it (issue 20).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_check import run_trainer, trainer_spec, write_results  # noqa: E402

# (seq_len, checkpointing, micro_batch): lengths the profile was not fitted on.
GPU_POINTS = [(8192, "none", 1), (8192, "selective", 2), (24576, "selective", 1),
              (32768, "none", 1), (32768, "full", 1), (49152, "selective", 1)]
DRY_POINTS = [(512, "none", 1), (512, "selective", 2), (1024, "full", 1)]


def point(gpu: str, model: str, seq: int, mode: str, micro_batch: int, steps: int, warmup: int,
          workdir: Path) -> dict:
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.steptime import predict_spec

    data = trainer_spec(model, seq, mode, steps + warmup, gpu, None)
    data["training"].update(micro_batch=micro_batch, global_batch=micro_batch)
    spec = validate_spec(data)
    predicted = predict_spec(spec, machine_for(spec))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny model, toy sizes")
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args()
    dry = args.dry_run
    gpu, model = ("cpu", "tiny") if dry else ("H200", "llama3.2-1b")
    points = DRY_POINTS if dry else GPU_POINTS
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": dry,
                     "points": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seq, mode, mb in points:
            try:
                row = point(gpu, model, seq, mode, mb, 2 if dry else 3, 1 if dry else 2,
                            Path(tmp))
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
