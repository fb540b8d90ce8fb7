"""Where the step-time model's fitted constants come from, and its held-out errors.

    .venv/bin/python benchmarks/fit_steptime.py            # the Megatron profile
    .venv/bin/python benchmarks/fit_steptime.py --bundled  # the bundled trainer's (H200)

Megatron profile: two efficiencies (the large-GEMM fraction of the BF16 and of the FP8 peak)
for every row of every table, fitted on the published runs' fit subset only
(ctxlaunch.perf.published.FIT_ROWS): the grid point with the smallest largest relative error,
each row's unstated settings chosen as the fastest that fits (as tests/unit/test_published_runs.py
does). The held-out rows (HELD_OUT_ROWS) are never seen by the fit; their errors are printed on
their own. Everything else is measured or a data sheet (ctxlaunch.perf.profiles). About a
minute on 2 busy cores.

Bundled profile: the H200 calibration that benchmarks/gpu_steptime.py measured
(calibration.gpu.measure_device: the projections' GEMM efficiency, the attention kernel's R
and L0, the blocks' elementwise rate, the loss's rate and the fixed cost from the trainer's
own steps at two depths), printed as ctxlaunch/perf/fitted/ctxlaunch-h200.json rounds it, then the seven trainer layouts
that calibration never ran, predicted with the committed profile against the trainer's
measured steps (the median of each layout's timed steps).

The chosen values are written into the data files under ctxlaunch/perf/fitted/ (with the
machine, command and date they come from); this script shows where they come from.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxlaunch.perf.published import (  # noqa: E402
    FIT_ROWS,
    HELD_OUT_ROWS,
    PublishedRun,
    best_fitting,
)
from ctxlaunch.perf.published import row_machine as machine_for  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_steptime-2026-12-04-run2.json"


def errors(rows: list[PublishedRun], eta_bf16: float, eta_fp8: float) -> list[float]:
    out = []
    for row in rows:
        machine = machine_for(row, eta_matmul={"bf16": eta_bf16, "fp8": eta_fp8, "fp32": eta_bf16})
        found = best_fitting(row, machine)
        assert found is not None, row.name
        predicted = found[1].model_flops_per_second_per_gpu[row.convention] / 1e12
        out.append(predicted / row.tflops_per_gpu - 1)
    return out


def summary(errs: list[float]) -> str:
    magnitudes = [abs(e) for e in errs]
    return (
        f"median |error| {statistics.median(magnitudes):.1%}, worst {max(magnitudes):.1%}, "
        f"{sum(m <= 0.15 for m in magnitudes)} of {len(errs)} within 15 %"
    )


def megatron() -> None:
    best: tuple[float, tuple[float, float]] | None = None
    for point in itertools.product(
        [x / 100 for x in range(66, 93, 2)], [x / 100 for x in range(36, 63, 2)]
    ):
        worst = max(abs(x) for x in errors(FIT_ROWS, *point))
        # Ties go to the smaller efficiencies (the more conservative prediction).
        if best is None or worst < best[0] - 1e-4:
            best = (worst, point)
    assert best is not None
    eta_bf16, eta_fp8 = best[1]
    print(f"megatron: eta_matmul bf16 {eta_bf16:.2f}, fp8 {eta_fp8:.2f}")
    for label, rows in (("fit", FIT_ROWS), ("held out", HELD_OUT_ROWS)):
        errs = errors(rows, eta_bf16, eta_fp8)
        print(f"{label} ({len(rows)} rows): {summary(errs)}")
        for row, e in zip(rows, errs, strict=True):
            print(f"  {row.name:34s} published {row.tflops_per_gpu:6.0f}  error {e:+6.1%}")


def bundled() -> None:
    from ctxlaunch.contract.hardware import GPUS
    from ctxlaunch.contract.spec import ModelSpec
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.machine import Machine
    from ctxlaunch.perf.steptime import predict

    data = json.loads(RESULTS.read_text())
    c = data["calibration"]
    gpu = GPUS["H200"]
    print(f"calibration ({c['device_name']}, {c['measured_at']}, {data['torch']}):")
    print(f"  eta_matmul_bf16 = {c['eta_matmul']:.3f}")
    print(
        f"  attention_fraction = {c['attention_fraction']:.3f} "
        f"({c['attention_fraction'] * gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s, "
        f"{c['attention_kernel']}), attention_ramp_tokens = "
        f"{c['attention_ramp_tokens']:.0f}"
    )
    print(
        f"  elementwise_fraction_of_hbm = {c['elementwise_fraction_of_hbm']:.3f}, "
        f"loss_fraction_of_hbm = {c['loss_fraction_of_hbm']:.3f}, "
        f"microbatch_overhead_seconds = {c['microbatch_overhead_seconds']:.4f}"
    )
    print(f"  its own held-out trainer step: {c['expected_error']:.1%} off")
    model = ModelSpec.model_validate({"preset": "llama3.2-1b"})
    machine = Machine.from_gpu(gpu, network="infiniband-ndr", gpus_per_node=1)
    errs = []
    print("held-out trainer layouts, the committed profile:")
    for point in data["points"]:
        measured = statistics.median(point["measured_steps"])
        st = predict(
            model,
            Layout(
                seq_len=point["seq_len"],
                micro_batch=point["micro_batch"],
                activation_checkpointing=point["checkpointing"],
            ),
            machine,
        )
        errs.append(st.step_seconds / measured - 1)
        print(
            f"  {point['seq_len']:6d} {point['checkpointing']:9s} x{point['micro_batch']}: "
            f"measured {measured:.3f} s, predicted {st.step_seconds:.3f} s ({errs[-1]:+.1%})"
        )
    print(f"  {summary(errs)}")
    print(f"  within 10 %: {sum(abs(e) <= 0.10 for e in errs)} of {len(errs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bundled",
        action="store_true",
        help="the bundled trainer's H200 constants instead of Megatron's",
    )
    if parser.parse_args().bundled:
        bundled()
    else:
        megatron()


if __name__ == "__main__":
    main()
