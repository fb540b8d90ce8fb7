"""Measuring this machine for the step-time model on `gpu: cpu`: matmul, attention through the
trainer's kernels, memory, gloo loopback and the real model's fixed cost. The record and its
file live in ctxlaunch.perf.machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ctxlaunch.perf.machine import (
    Calibration,
    GpuCalibration,
    load_calibration,
    save_calibration,
)

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from ctxlaunch.contract.spec import ModelSpec

__all__ = ["Calibration", "load_calibration", "measure", "save_calibration"]


# --------------------------------------------------------------------------------------------
# measuring (torch imported here only)
# --------------------------------------------------------------------------------------------
def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    import time

    fn()  # warm-up: thread pool, packing, allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_compute(
    *,
    heads: int = 4,
    head_dim: int = 32,
    seq: int = 2048,
    dtype: str = "fp32",
    repeats: int = 5,
    projections: tuple[tuple[int, int], ...] = (),
    threads: int = 0,
    attention_seq: int | None = None,
) -> tuple[float, float, float, float]:
    """(matmul FLOP/s, attention FLOP/s forward + backward on a full block, the causal
    diagonal's waste in tokens, copy bytes/s), each from the best of `repeats` runs with all of
    this machine's cores in this process. The matmul rate is the model's own: forward and both
    backward products of every (in, out) projection in `projections` over `seq` tokens (a
    1024-square product where none are given); small inner dimensions run well below a large
    square's rate. Attention runs through the trainer's own kernels (ctxlaunch.cp.kernels) at
    the model's heads and head_dim: 12 x heads x head_dim x s x s FLOPs on a full block; a
    causal block of s tokens takes as long as s*(s + T)/2 entries. `threads`: how many to use
    (0: every core). `attention_seq`: the block length the attention rate and T are measured
    on (default `seq`): the CPU kernel's thread scaling depends on it (BENCHMARKS.md 7a, "Why
    the five points miss")."""
    import os

    import torch

    from ctxlaunch.cp.kernels import attention_backward, attention_forward

    torch.set_num_threads(threads or os.cpu_count() or 1)
    kind = torch.float32 if dtype == "fp32" else torch.bfloat16
    if projections:
        weights = [torch.randn(i, o, dtype=kind) for i, o in projections]
        inputs = [torch.randn(seq, i, dtype=kind) for i, _ in projections]
        grads = [torch.randn(seq, o, dtype=kind) for _, o in projections]

        def products() -> None:
            for x, w, g in zip(inputs, weights, grads, strict=True):
                torch.mm(x, w)  # forward
                torch.mm(g, w.t())  # input gradient
                torch.mm(x.t(), g)  # weight gradient

        flops = sum(6.0 * seq * i * o for i, o in projections)
        matmul = flops / _best_seconds(products, repeats)
    else:
        n = 1024
        a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
        matmul = 2.0 * n**3 / _best_seconds(lambda: torch.mm(a, b), repeats)

    block = attention_seq or seq
    q = torch.randn(1, heads, block, head_dim, dtype=kind)
    k, v = torch.randn_like(q), torch.randn_like(q)
    scale = head_dim**-0.5

    def attention(causal: bool) -> None:
        out, lse = attention_forward(q, k, v, causal, scale)
        attention_backward(torch.ones_like(out), q, k, v, out, lse, causal, scale)

    full_seconds = _best_seconds(lambda: attention(False), repeats)
    causal_seconds = _best_seconds(lambda: attention(True), repeats)
    attention_rate = 12.0 * heads * head_dim * block * block / full_seconds
    # causal / full = (s + T) / (2 s)
    tile = max(block * (2 * causal_seconds / full_seconds - 1), 0.0)

    x = torch.empty(16 * 2**20, dtype=torch.float32)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 4 / _best_seconds(lambda: y.copy_(x), repeats)
    return matmul, attention_rate, tile, copy


def run_ranks(
    target: Callable[..., None],
    ranks: int,
    args: tuple[Any, ...],
    expect: int,
    timeout_s: float,
    what: str,
) -> list[Any]:
    """Run `target(rank, init_file, *args, results)` in `ranks` spawned processes; collect
    `expect` results. A process that dies or a run past `timeout_s` ends every process and
    raises RuntimeError: a measurement never hangs."""
    import os
    import queue
    import tempfile
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="ctxlaunch_calibrate_")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    procs = [
        ctx.Process(target=target, args=(r, init_file, *args, results), daemon=True)
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    values: list = []
    try:
        while len(values) < expect:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not finish in {timeout_s:.0f} s")
            try:
                values.append(results.get(timeout=1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        f"{what}: a process died (exit codes {[p.exitcode for p in procs]})"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return values


def _pingpong(
    rank: int, init_file: str, sizes: list[int], repeats: int, results: Queue[Any]
) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = []
    for size in sizes:
        buffer = torch.empty(size // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            best = min(best, (time.perf_counter() - start) / 2)
        out.append(best)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def _sync_worker(
    rank: int, init_file: str, world: int, runs: tuple[tuple[int, int], ...], results: Queue[Any]
) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    message = torch.zeros(1024)
    incoming = torch.empty_like(message)

    def run(a: torch.Tensor, iterations: int, exchange: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            torch.mm(a, a)
            if exchange:
                ops = [
                    dist.P2POp(dist.isend, message, (rank + 1) % world),
                    dist.P2POp(dist.irecv, incoming, (rank - 1) % world),
                ]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
        dist.barrier()
        return time.perf_counter() - start

    out = []
    for size, iterations in runs:
        a = torch.randn(size, size)
        run(a, iterations, True)  # warm-up
        alone = min(run(a, iterations, False) for _ in range(2))
        synced = min(run(a, iterations, True) for _ in range(2))
        out.append((max(synced - alone, 0.0) / iterations, alone / iterations))
    results.put((rank, out))
    dist.destroy_process_group()


def measure_sync_intervals(
    ranks: int, runs: tuple[tuple[int, int], ...], timeout_s: float = 120.0
) -> list[tuple[float, float]]:
    """Per (size, iterations) in `runs`, all in one set of processes: (seconds one ring exchange
    adds, seconds of compute between two exchanges) when `ranks` processes (one thread each)
    share the cores, as the trainer's ranks do: every rank computes one `size`-square product,
    then sends to the next and receives from the previous; less the same compute without the
    exchanges. Both are the mean over the ranks."""
    per_rank = [
        v
        for _, v in run_ranks(
            _sync_worker, ranks, (ranks, runs), ranks, timeout_s, "sync measurement"
        )
    ]
    return [
        (sum(r[i][0] for r in per_rank) / ranks, sum(r[i][1] for r in per_rank) / ranks)
        for i in range(len(runs))
    ]


def measure_sync(
    ranks: int, *, iterations: int = 40, size: int = 192, timeout_s: float = 120.0
) -> float:
    """Seconds one ring exchange adds between compute steps (`measure_sync_intervals`)."""
    return measure_sync_intervals(ranks, ((size, iterations),), timeout_s)[0][0]


SYNC_RUNS = ((192, 40), (768, 60))
"""(square product, iterations) the exchange is measured after: 192 (0.1-0.25 ms of one thread
here) for its cost with no compute to speak of, and 768 (about 6.5 ms, as long as a rank of the
CPU self-check computes between exchanges at its shortest, 4K CP 4; a size no trainer call
runs) for its growth. Beyond ~15 ms the cost of an exchange is lost in this machine's noise
(BENCHMARKS.md 7a, run 7)."""


def fit_sync_jitter(short: tuple[float, float], long: tuple[float, float]) -> tuple[float, float]:
    """(s0, c) of cost(tau) = s0 + c x sqrt(tau) through two (cost, tau) readings of an exchange
    after tau seconds of compute (`measure_sync_intervals` at two sizes); no growth, c = 0 and
    s0 the shorter reading, where the longer compute's exchange did not cost more (noise)."""
    (cost_short, tau_short), (cost_long, tau_long) = short, long
    if tau_long <= tau_short or cost_long <= cost_short:
        return cost_short, 0.0
    growth = (cost_long - cost_short) / (tau_long**0.5 - tau_short**0.5)
    return max(0.0, cost_short - growth * tau_short**0.5), growth


def measure_sync_curve(ranks: int, *, readings: int = 3) -> tuple[float, float]:
    """(s0, c) of `fit_sync_jitter` through the exchange's cost after each compute of SYNC_RUNS,
    each the median of `readings` runs (one run in three can read several times the others on
    a shared machine)."""
    import statistics

    taken = [measure_sync_intervals(ranks, SYNC_RUNS) for _ in range(readings)]
    short, long = (
        (statistics.median(r[i][0] for r in taken), statistics.median(r[i][1] for r in taken))
        for i in range(2)
    )
    return fit_sync_jitter(short, long)


def fit_line(xs: tuple[float, ...] | list[float], ys: list[float]) -> tuple[float, float]:
    """(bytes/s, latency s) of the least-squares line t = latency + x / bandwidth through the
    best time at each message size. A burst of load elsewhere can tilt the line: never below the
    largest message's own rate. The latency is the smallest message's time less its transfer
    (the intercept of a line through points this far apart is too noisy to use), at least 0."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = (
        sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
        if spread > 0
        else 0.0
    )
    bandwidth = max(1.0 / slope if slope > 0 else 0.0, xs[-1] / ys[-1])
    latency = max(ys[0] - xs[0] / bandwidth, 0.0)
    return bandwidth, latency


def measure_loopback(
    sizes: tuple[int, ...] = (4096, 262144, 4 * 2**20, 16 * 2**20),
    repeats: int = 5,
    timeout_s: float = 120.0,
) -> tuple[float, float]:
    """(bytes/s, latency s) of gloo point-to-point between two processes over 127.0.0.1: the
    least-squares line through the best one-way time at each message size."""
    (times,) = run_ranks(
        _pingpong, 2, (list(sizes), repeats), 1, timeout_s, "gloo loopback measurement"
    )
    bandwidth, latency = fit_line(sizes, times)
    return bandwidth, max(latency, 1e-6)


def _model_step_seconds(model: ModelSpec, seq: int, repeats: int, threads: int = 0) -> float:
    """Best time of the trainer's own model (forward, backward, AdamW step) at `seq` tokens,
    with `threads` threads in this process (0: every core)."""
    import os

    import torch

    from ctxlaunch.runtime.trainer.model import Transformer

    torch.set_num_threads(threads or os.cpu_count() or 1)
    net = Transformer.from_spec(model)
    net.init_weights(0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, model.vocab, (1, seq))
    positions = torch.arange(seq)

    def step() -> None:
        net(tokens, positions, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _best_seconds(step, repeats)


def measure_model_residual(
    model: ModelSpec,
    calibration: Calibration,
    *,
    lengths: tuple[int, int] = (256, 1024),
    repeats: int = 5,
    threads: int = 0,
) -> tuple[float, float]:
    """(fixed seconds per micro-batch, elementwise bytes/s) from the real model's step at two
    short lengths, where attention is small: what the matmul, attention and optimizer terms
    (at the rates just measured) leave is a fixed cost plus a per-token one. The per-token part
    is the elementwise work, which eager torch runs far below a copy's bandwidth on small
    tensors; it sets the elementwise rate, and the intercept the fixed cost (never negative).
    Measured at lengths the benchmark sweeps never use, so nothing is fitted on them. With
    `threads` = 1 the one-thread rates of `calibration` stand in (one rank per core)."""
    import dataclasses

    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.steptime import predict

    ranks = calibration.cores if threads == 1 else 1
    # The elementwise term at the copy rate (as `rate` below starts from), whatever was fitted.
    bare = dataclasses.replace(calibration, elementwise_bytes_per_second=0.0)
    machine = dataclasses.replace(
        bare.machine(gpus_per_node=ranks), microbatch_overhead_seconds=0.0, sync_seconds=0.0
    )
    residual, modelled_elementwise = [], []
    for seq in lengths:
        seconds = _model_step_seconds(model, seq, repeats, threads)
        terms = predict(
            model, Layout(seq_len=seq, dtype=model.dtype, matmul_precision=model.dtype), machine
        ).terms
        # The loss's passes run at the elementwise rate on the CPU (one rate fitted for both).
        elementwise = terms["compute_elementwise"] + terms["compute_loss"]
        residual.append(seconds - (sum(terms.values()) - elementwise))
        modelled_elementwise.append(elementwise)
    (s1, s2), (r1, r2), (e1, e2) = lengths, residual, modelled_elementwise
    per_token = (r2 - r1) / (s2 - s1)
    modelled_per_token = (e2 - e1) / (s2 - s1)
    rate = calibration.memory_bytes_per_second / ranks
    if per_token > 0.05 * modelled_per_token:  # a slope lost in noise keeps the copy rate
        rate *= modelled_per_token / per_token
    fixed = max(r1 - max(per_token, 0.0) * s1, 0.0)
    return fixed, rate


ATTENTION_SEQ = 6144
"""The block `ctxlaunch calibrate` measures the attention rate on: as long as the trainer's long
calls (one thread scales to two almost linearly there, on 2,048 tokens only 1.64x) and none of
the CPU self-check's lengths (BENCHMARKS.md 7a, runs 5 and 8)."""

ATTENTION_RAMP_SEQS = (1536, 6144)
"""Two block lengths to fit attention's rate and length ramp on: none of the lengths the
benchmark's calls run (benchmarks/steptime_cpu.py: 512 to 16,384, powers of two)."""


def median_each(readings: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The median of each position over equally long readings: (a1, b1), (a2, b2), ... ->
    (median a, median b)."""
    import statistics

    return tuple(statistics.median(values) for values in zip(*readings, strict=True))


def fit_ramp(short: int, short_rate: float, long: int, long_rate: float) -> tuple[float, float]:
    """(rate at any length, L0) of rate(L) = rate x L / (L + L0) through two measured rates:
    1 / rate(L) is linear in 1 / L. A rate that does not grow with the length (noise) gives no
    ramp: the longer block's rate, L0 = 0."""
    slope = (1 / short_rate - 1 / long_rate) / (1 / short - 1 / long)
    if slope <= 0:
        return long_rate, 0.0
    intercept = 1 / long_rate - slope / long
    if intercept <= 0:
        return long_rate, 0.0
    return 1 / intercept, slope / intercept


def measure(
    *,
    heads: int = 4,
    head_dim: int = 32,
    seq: int = 2048,
    dtype: str = "fp32",
    repeats: int = 5,
    sizes: tuple[int, ...] = (4096, 262144, 4 * 2**20, 16 * 2**20),
    model: ModelSpec | None = None,
    sync_ranks: tuple[int, ...] = (2, 4),
    attention_seq: int | None = None,
    attention_ramp_seqs: tuple[int, int] | None = None,
    sync_readings: int = 3,
    rate_readings: int = 3,
) -> Calibration:
    """Every constant the step-time model needs on this CPU; `model` (a ModelSpec, default the
    tiny preset) is what the matmul rate, the elementwise rate and the per-micro-batch overhead
    are measured on. Attention is measured on one block of `attention_seq` tokens (default
    `seq`) with no length ramp; or, given `attention_ramp_seqs` (two lengths, e.g.
    ATTENTION_RAMP_SEQS), on both and fitted to a rate and a ramp (`fit_ramp`), with all cores
    and with one thread (not the default: BENCHMARKS.md 7a, run 6). Each exchange cost is the
    median of `sync_readings` runs. Each compute rate, and the model's fixed cost and
    elementwise rate, is the median of `rate_readings` readings taken in turn (all cores, one
    thread, all cores, ...), so a minute of load elsewhere moves one reading, not the profile
    (one low attention reading, 91 GFLOP/s against 106-111, put the one-process points of
    BENCHMARKS.md 7a, run 10, 19-30 % slow)."""
    import dataclasses
    import datetime
    import os

    from ctxlaunch.contract.spec import ModelSpec

    model = model or ModelSpec.model_validate({"preset": "tiny", "dtype": dtype})
    projections = (
        (model.hidden, model.hidden + 2 * model.kv_hidden),  # fused q, k, v
        (model.hidden, model.hidden),  # output
        (model.hidden, 2 * model.ffn_hidden),  # fused gate, up
        (model.ffn_hidden, model.hidden),
    )  # down
    ramp_seqs = None if attention_seq else attention_ramp_seqs
    common: dict[str, Any] = dict(
        heads=heads,
        head_dim=head_dim,
        seq=seq,
        dtype=dtype,
        repeats=repeats,
        projections=projections,
    )

    def attention_rates(threads: int) -> tuple[float, float, float, float, float]:
        """(matmul, attention rate, ramp L0, causal tile, copy) with `threads` threads."""
        if ramp_seqs is None:
            m, a, t, c = measure_compute(**common, threads=threads, attention_seq=attention_seq)
            return m, a, 0.0, t, c
        short, long = ramp_seqs
        _, short_rate, _, _ = measure_compute(**common, threads=threads, attention_seq=short)
        m, long_rate, t, c = measure_compute(**common, threads=threads, attention_seq=long)
        rate, ramp = fit_ramp(short, short_rate, long, long_rate)
        return m, rate, ramp, t, c

    rounds = [(attention_rates(0), attention_rates(1)) for _ in range(rate_readings)]
    matmul, attention, ramp, tile, copy = median_each([r[0] for r in rounds])
    matmul_1, attention_1, ramp_1, _, _ = median_each([r[1] for r in rounds])
    bandwidth, latency = measure_loopback(sizes=sizes, repeats=repeats)
    calibration = Calibration(
        matmul_flops_per_second=matmul,
        attention_flops_per_second=attention,
        memory_bytes_per_second=copy,
        link_bytes_per_second=bandwidth,
        link_latency_seconds=latency,
        cores=os.cpu_count() or 1,
        causal_tile_tokens=tile,
        attention_ramp_tokens=ramp,
        # One thread: what each rank gets when the ranks fill the cores.
        one_thread={"matmul": matmul_1, "attention": attention_1, "attention_ramp_tokens": ramp_1},
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    residuals = [
        (
            measure_model_residual(model, calibration, repeats=repeats),
            measure_model_residual(model, calibration, repeats=repeats, threads=1),
        )
        for _ in range(rate_readings)
    ]
    overhead, elementwise = median_each([r[0] for r in residuals])
    overhead_1, elementwise_1 = median_each([r[1] for r in residuals])
    curves = {str(n): measure_sync_curve(n, readings=sync_readings) for n in sync_ranks}
    return dataclasses.replace(
        calibration,
        microbatch_overhead_seconds=overhead,
        elementwise_bytes_per_second=elementwise,
        sync_seconds={n: s0 for n, (s0, _) in curves.items()},
        sync_jitter={n: growth for n, (_, growth) in curves.items()},
        one_thread={
            "matmul": matmul_1,
            "attention": attention_1,
            "attention_ramp_tokens": ramp_1,
            "elementwise": elementwise_1,
            "microbatch_overhead": overhead_1,
        },
    )


# --------------------------------------------------------------------------------------------
# the calibration job's body (`ctxlaunch calibrate SPEC --submit` runs it instead of the trainer)
# --------------------------------------------------------------------------------------------
CALIBRATE_MODULE = "ctxlaunch.runtime.calibrate"


PROFILE_LINE = "ctxlaunch calibrate: profile "
"""How the calibration job's log line that carries its profile (JSON) begins."""


DRY_RUN_ENV = "CTXLAUNCH_CALIBRATE_DRY_RUN"
"""Set to 1, a GPU spec's calibration job runs the GPU code path on this CPU
(ctxlaunch.runtime.calibrate_device, `dry_run`): how the tests check the job where no GPU is.
Its profile says it is a dry run."""


def run_job(spec_path: str | None, out_path: str) -> int:
    """Measure this node for the spec at `spec_path` (spec.json; None: the spec in
    $CTXLAUNCH_SPEC_JSON, as the Slurm script passes it) and write its machine profile
    to `out_path`; returns the exit status. `gpu: cpu` measures this CPU (`measure`); a GPU
    spec measures the node's GPUs (ctxlaunch.runtime.calibrate_device), and is a clear error
    (exit 2) on a node without CUDA, never a profile of the CPU under a GPU's name."""
    import json
    import os
    import sys
    from pathlib import Path

    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.contract.rundir import SPEC_ENV
    from ctxlaunch.perf.machine import save_profile

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    data = json.loads(Path(spec_path).read_text() if spec_path else os.environ[SPEC_ENV])
    data.get("cluster", {}).pop("profile", None)  # the profile being written, not one to use
    spec = validate_spec(data, spec_path or SPEC_ENV)
    if rank != 0:
        return 0
    m = spec.model
    calibration: Calibration | GpuCalibration
    if spec.cluster.gpu != "cpu":
        from ctxlaunch.runtime.calibrate_device import measure_device

        dry_run = os.environ.get(DRY_RUN_ENV) == "1"
        print(
            f"ctxlaunch calibrate: measuring {spec.cluster.gpu} x "
            f"{spec.cluster.gpus_per_node} over {spec.fabric.network}"
            f"{' (dry run on the CPU)' if dry_run else ''}",
            flush=True,
        )
        try:
            calibration = measure_device(
                spec, dry_run=dry_run, log=lambda line: print(line, flush=True)
            )
        except RuntimeError as exc:
            print(f"ctxlaunch calibrate: cluster.gpu {spec.cluster.gpu!r}: {exc}", file=sys.stderr)
            return 2
    else:
        # Short on the CPU: 512-token attention, two repeats, one reading of each rate, three
        # message sizes, one sync width read once at each of its two compute lengths.
        calibration = measure(
            heads=m.heads,
            head_dim=m.head_dim,
            dtype=m.dtype,
            model=m,
            seq=512,
            repeats=2,
            sizes=(4096, 262144, 2**20),
            sync_ranks=(2,),
            sync_readings=1,
            rate_readings=1,
        )
    written = save_profile(calibration, spec, Path(out_path))
    # The profile in the log too: where the job's filesystem is not the submitter's (a pod).
    print(f"{PROFILE_LINE}{json.dumps(json.loads(written.read_text()))}")
    print(f"ctxlaunch calibrate: wrote {written}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"python -m {CALIBRATE_MODULE}", description=run_job.__doc__
    )
    parser.add_argument(
        "spec", nargs="?", default=None, help="the job's spec.json (default: $CTXLAUNCH_SPEC_JSON)"
    )
    parser.add_argument("--out", required=True, help="where to write the machine profile")
    args = parser.parse_args(argv)
    return run_job(args.spec, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
