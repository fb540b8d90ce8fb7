"""The calibration job: what `ctxlaunch calibrate SPEC --submit` runs on one node of the spec's
target, in place of the trainer.

`python -m ctxlaunch.runtime.calibration.job [SPEC] [--run-dir DIR] [--out PROFILE]` measures
the node for the spec (rank 0 only; the spec file, else $CTXLAUNCH_SPEC_JSON as the Slurm
script passes it), prints the machine profile as one log line that begins with
ctxlaunch.contract.rundir.RESULT_LINE (where the job's filesystem is not the submitter's, a
pod's, the result comes back through its log), and writes it to PROFILE when given.
`calibrate_node(spec_json, out)` is the same measurement as a function, for a function job
(submitit), which returns the profile. Both are what ctxlaunch.contract.rundir's
`calibration_entry` names.

`gpu: cpu` measures this CPU (ctxlaunch.runtime.calibration.cpu); a GPU spec measures the
node's GPUs (ctxlaunch.runtime.calibration.gpu), and is a clear error (exit 2) on a node without
CUDA, never a profile of the CPU under a GPU's name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.rundir import CALIBRATE_MODULE, RESULT_LINE, SPEC_ENV

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.perf.machine import Calibration, GpuCalibration

DRY_RUN_ENV = "CTXLAUNCH_CALIBRATE_DRY_RUN"
"""Set to 1, a GPU spec's calibration job runs the GPU code path on this CPU
(ctxlaunch.runtime.calibration.gpu, `dry_run`): how the tests check the job where no GPU is.
Its profile says it is a dry run."""


class CalibrationError(RuntimeError):
    """The node cannot be measured for the spec (a GPU spec on a node without CUDA, a model too
    large to calibrate on one GPU, a trainer run that failed): the job exits 2."""


def calibrate_node(spec_json: str, out: str | None = None) -> dict[str, Any]:
    """Measure this node for the spec `spec_json` (the resolved spec as JSON) and return its
    machine profile as JSON-able data, exactly what is written to `out` when given.
    CalibrationError (a RuntimeError) where the node cannot be measured for the spec."""
    spec = _calibration_spec(spec_json, "spec_json")
    return _profile(_measure(spec), spec, out)


def run_job(spec_path: str | None, out_path: str | None) -> int:
    """Measure this node for the spec at `spec_path` (spec.json; None: the spec in
    $CTXLAUNCH_SPEC_JSON, as the Slurm script passes it), print its machine profile as a
    RESULT_LINE and write it to `out_path` when given; returns the exit status. Only rank 0
    measures; every rank checks the spec."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    text = Path(spec_path).read_text() if spec_path else os.environ[SPEC_ENV]
    spec = _calibration_spec(text, spec_path or SPEC_ENV)
    if rank != 0:
        return exitcodes.OK
    try:
        calibration = _measure(spec)
    except CalibrationError as exc:
        print(f"ctxlaunch calibrate: {exc}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    profile = _profile(calibration, spec, out_path)
    print(f"{RESULT_LINE}{json.dumps(profile, separators=(',', ':'))}", flush=True)
    if out_path:
        print(f"ctxlaunch calibrate: wrote {Path(out_path)}", flush=True)
    return exitcodes.OK


def _calibration_spec(text: str, source: str) -> JobSpec:
    """The spec to calibrate for, validated, without its cluster.profile: the profile being
    measured, not one to use."""
    from ctxlaunch.contract.loader import validate_spec

    data = json.loads(text)
    data.get("cluster", {}).pop("profile", None)
    return validate_spec(data, source)


def _measure(spec: JobSpec) -> Calibration | GpuCalibration:
    """The node's constants for `spec`: this CPU on `gpu: cpu`, else the node's GPUs (or, with
    DRY_RUN_ENV set, the GPU code path on this CPU)."""
    if spec.cluster.gpu == "cpu":
        from ctxlaunch.runtime.calibration.cpu import measure

        # Short on the CPU: 512-token attention, two repeats, one reading of each rate, three
        # message sizes, one sync width read once at each of its two compute lengths.
        model = spec.model
        return measure(
            heads=model.heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
            model=model,
            seq=512,
            repeats=2,
            sizes=(4096, 262144, 2**20),
            sync_ranks=(2,),
            sync_readings=1,
            rate_readings=1,
        )
    from ctxlaunch.runtime.calibration.gpu import measure_device

    dry_run = os.environ.get(DRY_RUN_ENV) == "1"
    print(
        f"ctxlaunch calibrate: measuring {spec.cluster.gpu} x "
        f"{spec.cluster.gpus_per_node} over {spec.fabric.network}"
        f"{' (dry run on the CPU)' if dry_run else ''}",
        flush=True,
    )
    try:
        return measure_device(spec, dry_run=dry_run, log=lambda line: print(line, flush=True))
    except RuntimeError as exc:
        raise CalibrationError(f"cluster.gpu {spec.cluster.gpu!r}: {exc}") from exc


def _profile(
    calibration: Calibration | GpuCalibration, spec: JobSpec, out: str | None
) -> dict[str, Any]:
    """The machine profile of `calibration` as ctxlaunch.perf.machine.save_profile writes it,
    written to `out` when given."""
    from ctxlaunch.perf.machine import save_profile

    if out:
        return json.loads(save_profile(calibration, spec, Path(out)).read_text())
    with tempfile.TemporaryDirectory(prefix="ctxlaunch-profile-") as scratch:
        written = save_profile(calibration, spec, Path(scratch) / "profile.json")
        return json.loads(written.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {CALIBRATE_MODULE}", description=run_job.__doc__
    )
    parser.add_argument(
        "spec", nargs="?", default=None, help="the job's spec.json (default: $CTXLAUNCH_SPEC_JSON)"
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help="the job's run directory (the calibration keeps nothing there)",
    )
    parser.add_argument("--out", default=None, help="where to write the machine profile too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_job(args.spec, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
