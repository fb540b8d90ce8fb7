"""Measuring a GPU node for the step-time model: what the bundled trainer really runs there.

`ctxlaunch calibrate SPEC --submit` on a GPU spec runs `measure_device` in the calibration job
(ctxlaunch.runtime.calibration.job) on one node of the spec's own target. It measures, each
through the trainer's own code:

- the weight matmuls at the model's own projection shapes and compute precision (forward and
  both backward products), solved for the large-GEMM efficiency that the model's shape-level
  GEMM time (`profiles.gemm_seconds`: wave quantisation, memory-bound small GEMMs) needs to
  give the measured time;
- the attention kernel the trainer picks at that shape (`cp.kernel_choice.choose`), causal,
  forward and backward, at two call lengths: solved for its matmul rate and length ramp with
  the exponentials charged as the model charges them (`profiles.solve_attention`);
- the collectives among the node's GPUs (NCCL all-reduce, all-gather, reduce-scatter,
  all-to-all and send/recv, one process per GPU) at several message sizes: a bus bandwidth and
  a latency each, nccl-tests' bus-bandwidth convention;
- the real trainer (`python -m ctxlaunch.runtime.trainer`, one GPU, the spec's model cut to at
  most CALIBRATION_LAYERS blocks, the spec's checkpointing) at two lengths, and at the longer of
  them again with SHALLOW_LAYERS blocks: what its steps take beyond the matmuls, attention
  and optimizer just timed is a fixed cost per micro-batch, the blocks' elementwise work
  (norms, RoPE, SwiGLU, residuals, casts: grows with depth and length) and the loss's passes
  over its logits (grow with length only). The two depths tell the blocks' rate from the
  loss's, so the profile holds for the whole model's depth, not only the cut one's; the three
  runs set the two rates (as fractions of the HBM bandwidth) and the fixed cost
  (`fitting.fit_residual`). A fourth, longer step is held out and predicted with every
  constant above: its error is the profile's expected error.

Lengths come from the planner (the longest sequence the cut model fits on one GPU), so the job
never runs what the planner says will not fit. With `dry_run` the same code runs on this CPU
(gloo, the trainer on `gpu: cpu`, short lengths): it checks the job end to end where no GPU
is, and its profile says it is a dry run.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxlaunch.perf.machine import GpuCalibration
from ctxlaunch.runtime.calibration.fitting import fit_line, fit_residual
from ctxlaunch.runtime.calibration.measuring import block_projections, device_timer, run_ranks

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    import torch

    from ctxlaunch.contract.spec import JobSpec, ModelSpec

CALIBRATION_LAYERS = 4
"""Blocks of the spec's model the calibration's trainer steps run: enough for a per-block
figure, few enough that a 70B model's block fits one GPU beside its embedding and head."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

GPU_MESSAGE_BYTES = (1 << 20, 16 << 20, 128 << 20)
DRY_MESSAGE_BYTES = (1 << 16, 1 << 20)
SHALLOW_LAYERS = 1
"""Blocks of the calibration's shallow trainer run (the depth the loss's rate is told from)."""

DRY_LENGTHS = (256, 512, 1024)
"""(fit, fit, held out) trainer lengths of a dry run on the CPU."""


# --------------------------------------------------------------------------------------------
# matmuls and attention, in this process
# --------------------------------------------------------------------------------------------
def measure_matmul_eta(
    model: ModelSpec, gpu_name: str, device: torch.device, tokens: int, repeats: int
) -> tuple[float, float]:
    """(large-GEMM efficiency, measured seconds) of the block's projections over `tokens`
    tokens in the compute precision: the efficiency at which `profiles.gemm_seconds` sums to
    the measured time."""
    import torch

    from ctxlaunch.contract.hardware import GPUS
    from ctxlaunch.perf.profiles import gemm_seconds

    gpu = GPUS[gpu_name]
    element_type = torch.bfloat16 if model.dtype == "bf16" else torch.float32
    peak = gpu.peak_bf16_flops if model.dtype == "bf16" else gpu.peak_fp32_flops
    shapes = block_projections(model)
    weights = [torch.randn(i, o, dtype=element_type, device=device) for i, o in shapes]
    inputs = [torch.randn(tokens, i, dtype=element_type, device=device) for i, _ in shapes]
    grads = [torch.randn(tokens, o, dtype=element_type, device=device) for _, o in shapes]

    def products() -> None:
        for x, w, g in zip(inputs, weights, grads, strict=True):
            torch.mm(x, w)  # forward
            torch.mm(g, w.t())  # input gradient
            torch.mm(x.t(), g)  # weight gradient

    seconds = device_timer(device)(products, repeats)
    element_bytes = 2.0 if model.dtype == "bf16" else 4.0

    def at_full_efficiency(m: float, n: float, k: float) -> float:
        return gemm_seconds(
            m,
            n,
            k,
            peak=peak,
            eta=1.0,
            sm_count=gpu.sm_count,
            hbm_bytes_per_second=gpu.hbm_bytes_per_second,
            element_bytes=element_bytes,
        )

    ideal = sum(
        at_full_efficiency(tokens, o, i)
        + at_full_efficiency(tokens, i, o)
        + at_full_efficiency(i, o, tokens)
        for i, o in shapes
    )
    return min(ideal / seconds, 1.0), seconds


def measure_attention(
    model: ModelSpec, device: torch.device, lengths: tuple[int, int], repeats: int
) -> tuple[str, list[tuple[int, float, int, int]]]:
    """(the kernel the trainer picks at the longer length, [(call tokens, seconds, heads,
    head_dim)] of one causal forward + backward call at each length)."""
    import torch

    from ctxlaunch.cp.kernel_choice import choose
    from ctxlaunch.cp.kernels import attention_backward, attention_forward

    element_type = torch.bfloat16 if model.dtype == "bf16" else torch.float32
    heads, kv_heads, head_dim = model.heads, model.kv_heads, model.head_dim
    choice = choose(1, heads, kv_heads, max(lengths), head_dim, element_type, device)
    best_seconds = device_timer(device)
    scale = head_dim**-0.5
    calls = []
    for length in lengths:
        q = torch.randn(1, heads, length, head_dim, dtype=element_type, device=device)
        k = torch.randn(1, kv_heads, length, head_dim, dtype=element_type, device=device)
        v = torch.randn_like(k)
        grad = torch.randn_like(q)

        def call(
            q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, grad: torch.Tensor = grad
        ) -> None:
            out, lse = attention_forward(q, k, v, True, scale)
            attention_backward(grad, q, k, v, out, lse, True, scale)

        calls.append((length, best_seconds(call, repeats), heads, head_dim))
    return choice.kernel, calls


# --------------------------------------------------------------------------------------------
# collectives, one process per GPU
# --------------------------------------------------------------------------------------------
def _bus_bytes(op: str, size: int, world: int) -> float:
    """nccl-tests' bus bytes of one `op` over a `size`-byte buffer: what each rank's busiest
    link carries, so that bus bytes / time compares with the link's bandwidth."""
    if op == "all_reduce":
        return 2.0 * (world - 1) / world * size
    if op == "send_recv":
        return float(size)
    return (world - 1) / world * size


def _collective_worker(
    rank: int,
    init_file: str,
    world: int,
    backend: str,
    sizes: list[int],
    repeats: int,
    results: Queue[Any],
) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    best_seconds = device_timer(device)
    # torch 2.13 names them *_single; the *_tensor names before.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    times: dict[str, list[float]] = {op: [] for op in COLLECTIVES}
    for size in sizes:
        elements = size // 2 // world * world  # bf16 elements, divisible by the world
        full = torch.ones(elements, dtype=torch.bfloat16, device=device)
        part = torch.ones(elements // world, dtype=torch.bfloat16, device=device)
        other = torch.empty_like(full)

        def run_op(
            op: str,
            full: torch.Tensor = full,
            part: torch.Tensor = part,
            other: torch.Tensor = other,
        ) -> None:
            if op == "all_reduce":
                dist.all_reduce(full)
            elif op == "all_gather":
                all_gather(full, part)
            elif op == "reduce_scatter":
                reduce_scatter(part, full)
            elif op == "all_to_all":
                dist.all_to_all_single(other, full)
            elif rank < 2:  # send_recv: a ping-pong between ranks 0 and 1
                peer = 1 - rank
                if rank == 0:
                    dist.send(full, peer)
                    dist.recv(full, peer)
                else:
                    dist.recv(full, peer)
                    dist.send(full, peer)

        for op in COLLECTIVES:
            dist.barrier()
            seconds = best_seconds(functools.partial(run_op, op), repeats)
            times[op].append(seconds / 2 if op == "send_recv" else seconds)  # one way
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def measure_collectives(
    world: int, backend: str, sizes: tuple[int, ...], repeats: int, timeout_s: float = 300.0
) -> dict[str, dict[str, float]]:
    """{op: {"bus_bytes_per_second", "latency_seconds"}} among `world` processes (one per GPU
    with nccl)."""
    (times,) = run_ranks(
        _collective_worker,
        world,
        (world, backend, list(sizes), repeats),
        1,
        timeout_s,
        f"{backend} collectives measurement",
    )
    fitted = {}
    for op in COLLECTIVES:
        bus = [_bus_bytes(op, size // 2 // world * world * 2, world) for size in sizes]
        bandwidth, latency = fit_line(bus, times[op])
        fitted[op] = {"bus_bytes_per_second": bandwidth, "latency_seconds": latency}
    return fitted


# --------------------------------------------------------------------------------------------
# the real trainer at three lengths
# --------------------------------------------------------------------------------------------
def trainer_spec_data(
    spec: JobSpec, seq: int, steps: int, gpu: str, layers: int = CALIBRATION_LAYERS
) -> dict[str, Any]:
    """The calibration's trainer run: the spec's model cut to `layers` blocks (random
    weights), one rank on `gpu`, the spec's checkpointing and dtype, one sequence per step."""
    model = spec.model.model_dump(mode="json", exclude={"preset", "init_from"})
    model["layers"] = min(model["layers"], layers)
    return {
        "name": f"calibrate-{seq}",
        "model": model,
        "training": {
            "seq_len": seq,
            "steps": steps,
            "micro_batch": 1,
            "global_batch": 1,
            "activation_checkpointing": spec.training.activation_checkpointing,
            "zero_stage": 0,
        },
        "cluster": {"target": "local", "gpu": gpu, "gpus_per_node": 1},
    }


def _solo_trainer_env() -> dict[str, str]:
    """The environment of a trainer run of its own: a world of one on a free local port. None
    of the launcher's (torchrun's agent store, Slurm's ranks, the job's spec) reaches it, or it
    would wait for peers that are not coming."""
    from ctxlaunch.contract.rundir import JOB_ID_ENV, RUN_DIR_ENV, SPEC_ENV
    from ctxlaunch.runtime.parallel.distenv import free_local_port

    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TORCHELASTIC_", "SLURM_", "PET_", "GROUP_", "ROLE_"))
        and key not in (SPEC_ENV, RUN_DIR_ENV, JOB_ID_ENV)
    }
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_local_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_trainer_steps(data: dict[str, Any], workdir: Path, warmup: int, timeout_s: float) -> float:
    """The median step time after `warmup` steps of the real trainer run on `data` in its own
    process (one slow step, a host hiccup, does not move it); RuntimeError naming the run and
    its log's end where it fails."""
    import yaml

    from ctxlaunch.contract.rundir import TRAINER_MODULE

    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    seq_len = data["training"]["seq_len"]
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                TRAINER_MODULE,
                str(spec_path),
                "--run-dir",
                str(workdir / "run"),
            ],
            env=_solo_trainer_env(),
            text=True,
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"trainer at {seq_len} tokens did not finish in {timeout_s:.0f} s"
        ) from None
    metrics = workdir / "run" / "metrics.jsonl"
    steps = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line]
        if metrics.exists()
        else []
    )
    timed = [s["step_seconds"] for s in steps[warmup:] if "step_seconds" in s]
    if done.returncode != 0 or not timed:
        tail = (done.stdout + done.stderr)[-1500:]
        raise RuntimeError(f"trainer at {seq_len} tokens failed (exit {done.returncode}):\n{tail}")
    return statistics.median(timed)


def calibration_lengths(spec: JobSpec, gpu: str) -> tuple[int, int, int]:
    """(fit, fit, held out) lengths for the trainer runs on one GPU: 3/16, 3/8 and 3/4 of the
    longest sequence the planner says the cut model fits there (at most 32K): 6K, 12K and 24K
    for a small model, none of them a power of two that a benchmark's points would use."""
    from ctxlaunch.contract.hardware import GPUS
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.memory import longest_sequence

    cut = validate_spec(trainer_spec_data(spec, 1024, 1, gpu))
    longest = longest_sequence(cut.model, Layout.from_spec(cut), GPUS[gpu])
    top = min(longest, 32768) // 1024 * 1024
    if top < 8192:
        raise RuntimeError(
            f"the planner fits only {longest} tokens of the calibration model "
            f"({CALIBRATION_LAYERS} blocks of the spec's) on one {gpu}: too "
            "short to calibrate on"
        )
    return top * 3 // 16 // 256 * 256, top * 3 // 8 // 256 * 256, top * 3 // 4 // 256 * 256


# --------------------------------------------------------------------------------------------
# the whole measurement
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Node:
    """Where the measurement runs and at what sizes: the node's GPUs, or this CPU (dry run)."""

    device: torch.device
    backend: str
    """The collectives' backend: nccl, or gloo on the CPU."""
    device_name: str
    world: int
    """Processes the collectives run in (one per GPU)."""
    message_sizes: tuple[int, ...]
    lengths: tuple[int, int, int]
    """(fit, fit, held out) trainer lengths."""
    trainer_gpu: str
    """The trainer runs' cluster.gpu."""
    repeats: int
    dry_run: bool


def _node(spec: JobSpec, dry_run: bool, repeats: int | None) -> _Node:
    """The node to measure `spec`'s GPU on; RuntimeError where it has no CUDA device (never a
    profile of the CPU under a GPU's name) or the planner fits too little on one GPU."""
    import torch

    if dry_run:
        return _Node(
            device=torch.device("cpu"),
            backend="gloo",
            device_name="cpu (dry run)",
            world=min(spec.cluster.gpus_per_node, 2),
            message_sizes=DRY_MESSAGE_BYTES,
            lengths=DRY_LENGTHS,
            trainer_gpu="cpu",
            repeats=repeats or 2,
            dry_run=True,
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA device on this node (torch.cuda.is_available() is "
            "False): a GPU profile is measured on the GPU it names"
        )
    device = torch.device("cuda", 0)
    return _Node(
        device=device,
        backend="nccl",
        device_name=torch.cuda.get_device_name(device),
        world=min(spec.cluster.gpus_per_node, torch.cuda.device_count()),
        message_sizes=GPU_MESSAGE_BYTES,
        lengths=calibration_lengths(spec, spec.cluster.gpu),
        trainer_gpu=spec.cluster.gpu,
        repeats=repeats or 10,
        dry_run=False,
    )


def measure_device(
    spec: JobSpec,
    *,
    dry_run: bool = False,
    repeats: int | None = None,
    log: Callable[[str], None] = print,
) -> GpuCalibration:
    """Every constant of a GPU machine profile for `spec`'s GPU type and fabric, measured on
    this node (see the module docstring); `dry_run`: the same code on this CPU."""
    node = _node(spec, dry_run, repeats)
    calibration, attention_lengths = _measure_kernels(spec, node, log)
    runs, measured = _time_trainer(spec, node, log)
    return _fit_trainer(spec, node, calibration, runs, measured, attention_lengths, log)


def _measure_kernels(
    spec: JobSpec, node: _Node, log: Callable[[str], None]
) -> tuple[GpuCalibration, list[int]]:
    """The profile's collectives, matmul efficiency and attention rate (the trainer's fitted
    constants still unset), and the attention call lengths measured."""
    import torch

    from ctxlaunch.contract.hardware import GPUS
    from ctxlaunch.perf.profiles import solve_attention

    gpu = GPUS[spec.cluster.gpu]
    model = spec.model
    fit_short, fit_long, _ = node.lengths
    # Collectives first: the worker processes take the GPUs before this process holds any.
    collectives: dict[str, dict[str, float]] = {}
    if node.world > 1:
        collectives = measure_collectives(
            node.world, node.backend, node.message_sizes, node.repeats
        )
        for op, c in collectives.items():
            log(
                f"  {op}: {c['bus_bytes_per_second'] / 1e9:.2f} GB/s bus, "
                f"{c['latency_seconds'] * 1e6:.1f} us"
            )
    eta, matmul_s = measure_matmul_eta(model, spec.cluster.gpu, node.device, fit_long, node.repeats)
    log(f"  matmuls at {fit_long} tokens: {matmul_s * 1e3:.2f} ms, efficiency {eta:.3f}")
    kernel, calls = measure_attention(
        model, node.device, (fit_short * 3 // 2, fit_long * 3 // 2), node.repeats
    )
    peak = gpu.peak_bf16_flops if model.dtype == "bf16" else gpu.peak_fp32_flops
    fraction, ramp = solve_attention(calls, peak=peak, sfu_ops_per_second=gpu.sfu_ops_per_second)
    log(
        f"  attention ({kernel}) at {[c[0] for c in calls]} tokens: "
        f"{[round(c[1] * 1e3, 3) for c in calls]} ms, rate {fraction:.3f} of the peak, "
        f"ramp {ramp:.0f} tokens"
    )
    if node.device.type == "cuda":
        torch.cuda.empty_cache()
    calibration = GpuCalibration(
        gpu=spec.cluster.gpu,
        device_name=node.device_name,
        network=spec.fabric.network,
        gpus_per_node=spec.cluster.gpus_per_node,
        precision=model.dtype,
        eta_matmul=eta,
        attention_fraction=fraction,
        attention_ramp_tokens=ramp,
        attention_kernel=kernel,
        collectives=collectives,
        dry_run=node.dry_run,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    return calibration, [c[0] for c in calls]


def _time_trainer(
    spec: JobSpec, node: _Node, log: Callable[[str], None]
) -> tuple[list[tuple[int, int]], dict[tuple[int, int], float]]:
    """The trainer's (blocks, tokens) runs, in order: deep at both fit lengths, shallow at the
    longer one, deep at the held-out length; and the median step seconds of each. The
    shallow run tells the blocks' elementwise work from the loss's passes."""
    warmup, steps = (1, 3) if node.dry_run else (3, 8)
    fit_short, fit_long, held = node.lengths
    layers = spec.model.layers
    deep, shallow = min(CALIBRATION_LAYERS, layers), min(SHALLOW_LAYERS, layers)
    runs = [(deep, fit_short), (deep, fit_long), (shallow, fit_long), (deep, held)]
    measured: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="ctxlaunch-calibrate-") as tmp:
        for depth, seq in runs:
            data = trainer_spec_data(spec, seq, warmup + steps, node.trainer_gpu, depth)
            measured[depth, seq] = run_trainer_steps(
                data, Path(tmp) / f"{depth}-{seq}", warmup, timeout_s=240 if node.dry_run else 600
            )
            log(f"  trainer, {depth} blocks at {seq} tokens: {measured[depth, seq]:.4f} s per step")
    return runs, measured


def _fit_trainer(
    spec: JobSpec,
    node: _Node,
    calibration: GpuCalibration,
    runs: list[tuple[int, int]],
    measured: dict[tuple[int, int], float],
    attention_lengths: list[int],
    log: Callable[[str], None],
) -> GpuCalibration:
    """`calibration` completed from the trainer's steps: fixed cost + the blocks' elementwise
    work + the loss's passes, beyond what the kernels' constants time, fitted on the first
    three runs; the fourth, held out, predicted with every constant sets the expected error."""
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.steptime import predict

    def step_terms(depth: int, seq: int, machine_calibration: GpuCalibration) -> dict[str, float]:
        cut = validate_spec(trainer_spec_data(spec, seq, 1, node.trainer_gpu, depth))
        return predict(
            cut.model, Layout.from_spec(cut), machine_calibration.machine(gpus_per_node=1)
        ).terms

    # At the HBM bandwidth (fractions 1), with no fixed cost: what the model times.
    bare = dataclasses.replace(
        calibration,
        elementwise_fraction_of_hbm=1.0,
        loss_fraction_of_hbm=1.0,
        microbatch_overhead_seconds=0.0,
    )
    fraction, loss_fraction, fixed = fit_residual(
        [(measured[run], step_terms(*run, bare)) for run in runs[:3]]
    )
    calibration = dataclasses.replace(
        calibration,
        elementwise_fraction_of_hbm=fraction,
        loss_fraction_of_hbm=loss_fraction,
        microbatch_overhead_seconds=fixed,
    )
    held_run = runs[3]
    predicted = sum(step_terms(*held_run, calibration).values())
    error = predicted / measured[held_run] - 1
    fit_short, fit_long, held = node.lengths
    shallow_depth, _ = runs[2]
    log(
        f"  elementwise at {fraction:.4f} and the loss at {loss_fraction:.4f} of the HBM "
        f"bandwidth, {fixed * 1e3:.2f} ms fixed per micro-batch; held out {held} tokens: "
        f"predicted {predicted:.4f} s, measured {measured[held_run]:.4f} s ({error:+.1%})"
    )
    return dataclasses.replace(
        calibration,
        expected_error=abs(error),
        lengths={
            "matmul": fit_long,
            "attention": attention_lengths,
            "trainer_fit": [fit_short, fit_long],
            "trainer_held_out": held,
            "trainer_shallow_layers": shallow_depth,
        },
        trainer_step_seconds={f"{depth}x{seq}": v for (depth, seq), v in measured.items()},
    )
