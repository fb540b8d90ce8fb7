"""What sets the longest sequence `plan` reports with the offload recipe, and what the GPU
evidence says about loosening it. Pure planner arithmetic (no torch, no device).

    .venv/bin/python benchmarks/reach_limit.py [--json reach_limit.json]

For Llama-3.1-8B on 80 GB H100s, 8 a node (jobs/llama3-8b-128k-slurm.yaml at CP 1, 8 and 32,
DP 1), with the offload recipe `plan` uses (planning.plan.offload_recipe):

- the reach as `plan` computes it (`memory.longest_sequence`, device and host memory);
- at that length, the two bounds `memory.estimate` takes the larger of: the sum of the parts
  (saved activations + one attention call's backward buffers + one block recomputed + the
  gradients flowing between blocks, all at once) and the phase-by-phase peak
  (`peakphases.peak`, held to the CPU allocator's record within 2 %); each with the same
  allowance on top;
- the reach if the phase peak alone were planned (what loosening the bound would give).

Then, for each layout of the recorded H200 runs (benchmarks/results/gpu_steptime-*.json: the
trainer, llama3.2-1b shape, one GPU), the phase peak alone and the whole estimate against
`torch.cuda.max_memory_allocated`: whether the phase peak alone would have been under.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "llama3-8b-128k-slurm.yaml"
RESULTS = ROOT / "benchmarks" / "results"
GiB = 1 << 30
# Arctic Long Sequence Training's published reach for Llama-3.1-8B on H100s, by GPU count
# (arXiv 2506.13996, the anchor ctxlaunch's offload recipe is measured against).
ARCTIC_REACH = {1: 500_000, 8: 3_700_000, 32: 15_000_000}


def phase_only_total(model, layout, gpu) -> float:
    """`estimate`'s total had it planned the phase peak alone (no sum-of-the-parts bound)."""
    from ctxlaunch.perf.memory import (
        CPU_FIXED_ALLOWANCE,
        FRAGMENTATION,
        GPU_FIXED_ALLOWANCE,
        cuda_kernel_allowance,
        peak,
    )
    from ctxlaunch.perf.modelstates import communication_buffer_bytes, deepspeed_bucket_bytes

    known = (
        peak(model, layout).total
        - deepspeed_bucket_bytes(layout)
        + communication_buffer_bytes(layout)
    )
    fixed = (
        CPU_FIXED_ALLOWANCE
        if gpu.name == "cpu"
        else GPU_FIXED_ALLOWANCE + cuda_kernel_allowance(model, layout)
    )
    return known * (1 + FRAGMENTATION) + fixed


def phase_only_reach(model, layout, gpu, host) -> int:
    """The longest sequence the phase peak alone would allow (device and host memory)."""
    from ctxlaunch.perf.hostmemory import host_estimate
    from ctxlaunch.perf.memory import sequence_granularity

    unit = sequence_granularity(layout.cp, layout.cp_sharding)

    def fits(units: int) -> bool:
        at = layout.replace(seq_len=units * unit)
        total = phase_only_total(model, at, gpu)
        return total <= gpu.memory_bytes and host_estimate(model, at, host, int(total)).fits

    fitting, too_long = 0, (1 << 24) // unit
    if fits(too_long):
        return too_long * unit
    while too_long - fitting > 1:
        middle = (fitting + too_long) // 2
        fitting, too_long = (middle, too_long) if fits(middle) else (fitting, middle)
    return fitting * unit


def reach_rows() -> list[dict]:
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.perf.hostmemory import host_estimate
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.memory import estimate, longest_sequence, peak, sequence_granularity
    from ctxlaunch.planning.plan import host_limit, offload_recipe

    rows = []
    for gpus in (1, 8, 32):
        nodes, per_node = max(gpus // 8, 1), min(gpus, 8)
        spec = load_spec(
            JOB,
            [
                f"parallel.cp={gpus}",
                "parallel.cp_algorithm=ring",
                "training.zero_stage=3",
                "training.activation_checkpointing=full",
                "training.global_batch=1",
                f"cluster.nodes={nodes}",
                f"cluster.gpus_per_node={per_node}",
            ],
        )
        gpu, host, model = spec.cluster.gpu_info, host_limit(spec), spec.model
        best, recipe = 0, None
        for candidate in offload_recipe(spec, Layout.from_spec(spec)):
            n = longest_sequence(model, candidate, gpu, candidate.dims.cp_sharding, host=host)
            if n > best:
                best, recipe = n, candidate
        assert recipe is not None
        at = recipe.replace(seq_len=best)
        whole = estimate(model, at, gpu)
        phase = peak(model, at)
        # The anchor's length on the same layout, rounded down to a length the layout takes.
        unit = sequence_granularity(recipe.dims.cp, recipe.dims.cp_sharding)
        anchor = recipe.replace(seq_len=ARCTIC_REACH[gpus] // unit * unit)
        rows.append(
            {
                "gpus": gpus,
                "cp_algorithm": recipe.dims.cp_algorithm,
                "ulysses_degree": recipe.dims.ulysses_degree,
                "reach": best,
                "tokens_per_rank": at.tokens_per_rank,
                "estimate_gib": whole.total / GiB,
                "capacity_gib": whole.capacity / GiB,
                "sum_of_parts_workspace_gib": whole.workspace / GiB,
                "phase_peak_gib": phase.total / GiB,
                "phase_peak_phase": phase.name,
                "phase_only_estimate_gib": phase_only_total(model, at, gpu) / GiB,
                "host_per_node_gib": host_estimate(model, at, host, whole.total).per_node / GiB,
                "reach_phase_peak_alone": phase_only_reach(model, recipe, gpu, host),
                "arctic_reach": ARCTIC_REACH[gpus],
                "estimate_at_arctic_gib": estimate(model, anchor, gpu).total / GiB,
                "phase_peak_at_arctic_gib": peak(model, anchor).total / GiB,
                "phase_only_estimate_at_arctic_gib": phase_only_total(model, anchor, gpu) / GiB,
            }
        )
    return rows


def h200_rows() -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import trainer_spec

    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.memory import estimate, peak

    rows = []
    for path in sorted(RESULTS.glob("gpu_steptime-*.json")):
        name, recorded = path.name, json.loads(path.read_text())
        for point in recorded["points"]:
            if "max_allocated_bytes" not in point:
                continue
            data = trainer_spec(
                "llama3.2-1b", point["seq_len"], point["checkpointing"], 3, "H200", None
            )
            data["training"].update(
                micro_batch=point["micro_batch"], global_batch=point["micro_batch"]
            )
            spec = validate_spec(data)
            layout = Layout.from_spec(spec)
            whole = estimate(spec.model, layout, spec.cluster.gpu_info)
            allocated = point["max_allocated_bytes"]
            rows.append(
                {
                    "run": name,
                    "seq_len": point["seq_len"],
                    "checkpointing": point["checkpointing"],
                    "micro_batch": point["micro_batch"],
                    "max_allocated_gb": allocated / 1e9,
                    "estimate_over_allocated": (whole.total - whole.allowance) / allocated,
                    "phase_peak_over_allocated": peak(spec.model, layout).total / allocated,
                    "phase_peak_phase": peak(spec.model, layout).name,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    reach, h200 = reach_rows(), h200_rows()
    print(
        "GPUs | CP | reach | estimate GiB | phase peak GiB (phase) | phase-only GiB | "
        "host GiB/node | reach, phase peak alone"
    )
    for r in reach:
        algorithm = r["cp_algorithm"] + (
            f" {r['ulysses_degree']}" if r["cp_algorithm"] != "ring" else ""
        )
        print(
            f"{r['gpus']} | {algorithm} | {r['reach']:,} | {r['estimate_gib']:.2f} of "
            f"{r['capacity_gib']:.2f} (sum-of-parts workspace {r['sum_of_parts_workspace_gib']:.2f})"
            f" | {r['phase_peak_gib']:.2f} ({r['phase_peak_phase']}) | "
            f"{r['phase_only_estimate_gib']:.2f} | {r['host_per_node_gib']:.0f} | "
            f"{r['reach_phase_peak_alone']:,}"
        )
    print("GPUs | Arctic's length | estimate GiB | phase peak GiB | phase-only GiB")
    for r in reach:
        print(
            f"{r['gpus']} | {r['arctic_reach']:,} | {r['estimate_at_arctic_gib']:.2f} | "
            f"{r['phase_peak_at_arctic_gib']:.2f} | {r['phase_only_estimate_at_arctic_gib']:.2f}"
        )
    print(
        "H200 run | seq | checkpointing | micro-batches | max allocated GB | "
        "estimate / allocated | phase peak / allocated (phase)"
    )
    for h in h200:
        print(
            f"{h['run']} | {h['seq_len']:,} | {h['checkpointing']} | {h['micro_batch']} | "
            f"{h['max_allocated_gb']:.2f} | {h['estimate_over_allocated']:.3f} | "
            f"{h['phase_peak_over_allocated']:.3f} ({h['phase_peak_phase']})"
        )
    if args.json:
        args.json.write_text(json.dumps({"reach": reach, "h200": h200}, indent=2) + "\n")


if __name__ == "__main__":
    main()
