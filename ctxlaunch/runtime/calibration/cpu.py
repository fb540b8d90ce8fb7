"""Measuring this CPU for the step-time model on `gpu: cpu`: matmul, attention through the
trainer's kernels, memory, gloo loopback, the exchange cost between ranks that share the cores,
and the real model's fixed cost and elementwise rate. `ctxlaunch calibrate` runs `measure`
where it is typed; the calibration job (ctxlaunch.runtime.calibration.job) runs it on a node
of a `gpu: cpu` spec. The record and its file live in ctxlaunch.perf.machine."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

from ctxlaunch.perf.machine import Calibration, host_signature
from ctxlaunch.runtime.calibration.fitting import fit_line, fit_ramp, fit_sync_jitter, median_each
from ctxlaunch.runtime.calibration.measuring import best_seconds, block_projections, run_ranks
from ctxlaunch.runtime.progress import Progress

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    import torch

    from ctxlaunch.contract.spec import ModelSpec


ATTENTION_SEQ = 6144
"""The block `ctxlaunch calibrate` measures the attention rate on: as long as the trainer's long
calls and none of the CPU self-check's lengths (benchmarks/steptime_cpu.py). The CPU kernel's
thread scaling grows with the block up to a few thousand tokens, so a rate taken on a short
block understates what every core does on the long calls that dominate a step
(benchmarks/attention_threads_cpu.py measures the scaling; BENCHMARKS.md, step-time model:
the CPU calibration's choices)."""

ATTENTION_RAMP_SEQS = (1536, 6144)
"""Two block lengths to fit attention's rate and length ramp on: none of the lengths the
benchmark's calls run (benchmarks/steptime_cpu.py: 512 to 16,384, powers of two)."""

SYNC_RUNS = ((192, 40), (768, 60))
"""(square product, iterations) the exchange is measured after: 192, a product far shorter
than the exchange, for its cost with no compute to speak of; and 768, about as long as a rank
of the CPU self-check computes between exchanges at its shortest (4K, CP 4) and a size no
trainer call runs, for its growth. Nothing longer: after more compute the exchange's cost is
smaller than the compute's own variation between runs, and a reading of it is noise
(benchmarks/sync_cpu.py measures the cost against the compute; BENCHMARKS.md, step-time
model: the CPU calibration's choices)."""

LOOPBACK_SIZES = (4096, 262144, 4 * 2**20, 16 * 2**20)
"""Message bytes the gloo loopback line is fitted through."""


# --------------------------------------------------------------------------------------------
# compute rates, in this process
# --------------------------------------------------------------------------------------------
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
    diagonal's waste in tokens, copy bytes/s), each from the best of `repeats` runs with every
    core of the machine in this process. The matmul rate is the model's own: forward and both
    backward products of every (in, out) projection in `projections` over `seq` tokens (a
    1024-square product where none are given); small inner dimensions run well below a large
    square's rate. Attention runs through the trainer's own kernels (ctxlaunch.cp.kernels) at
    the model's heads and head_dim: 12 x heads x head_dim x s x s FLOPs on a full block; a
    causal block of s tokens takes as long as s*(s + T)/2 entries. `threads`: how many to use
    (0: every core). `attention_seq`: the block length the attention rate and T are measured
    on (default `seq`): the CPU kernel's thread scaling depends on it (ATTENTION_SEQ)."""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
    element_type = torch.float32 if dtype == "fp32" else torch.bfloat16
    matmul = _matmul_rate(projections, seq, element_type, repeats)
    attention_rate, tile = _attention_rate(
        heads, head_dim, attention_seq or seq, element_type, repeats
    )
    source = torch.empty(16 * 2**20, dtype=torch.float32)
    target = torch.empty_like(source)
    copy = 2 * source.numel() * 4 / best_seconds(lambda: target.copy_(source), repeats)
    return matmul, attention_rate, tile, copy


def _matmul_rate(
    shapes: tuple[tuple[int, int], ...], tokens: int, element_type: torch.dtype, repeats: int
) -> float:
    """FLOP/s of the forward and both backward products of each (in, out) in `shapes` over
    `tokens` tokens; of a 1024-square product where `shapes` is empty."""
    import torch

    if not shapes:
        size = 1024
        a, b = (
            torch.randn(size, size, dtype=element_type),
            torch.randn(size, size, dtype=element_type),
        )
        return 2.0 * size**3 / best_seconds(lambda: torch.mm(a, b), repeats)
    weights = [torch.randn(i, o, dtype=element_type) for i, o in shapes]
    inputs = [torch.randn(tokens, i, dtype=element_type) for i, _ in shapes]
    grads = [torch.randn(tokens, o, dtype=element_type) for _, o in shapes]

    def products() -> None:
        for x, w, g in zip(inputs, weights, grads, strict=True):
            torch.mm(x, w)  # forward
            torch.mm(g, w.t())  # input gradient
            torch.mm(x.t(), g)  # weight gradient

    flops = sum(6.0 * tokens * i * o for i, o in shapes)
    return flops / best_seconds(products, repeats)


def _attention_rate(
    heads: int, head_dim: int, block: int, element_type: torch.dtype, repeats: int
) -> tuple[float, float]:
    """(FLOP/s of the trainer's attention kernels forward + backward on a full block of
    `block` tokens, the causal diagonal's waste T in tokens)."""
    import torch

    from ctxlaunch.cp.kernels import attention_backward, attention_forward

    q = torch.randn(1, heads, block, head_dim, dtype=element_type)
    k, v = torch.randn_like(q), torch.randn_like(q)
    scale = head_dim**-0.5

    def attention(causal: bool) -> None:
        out, lse = attention_forward(q, k, v, causal, scale)
        attention_backward(torch.ones_like(out), q, k, v, out, lse, causal, scale)

    full_seconds = best_seconds(lambda: attention(False), repeats)
    causal_seconds = best_seconds(lambda: attention(True), repeats)
    rate = 12.0 * heads * head_dim * block * block / full_seconds
    # causal / full = (s + T) / (2 s)
    tile = max(block * (2 * causal_seconds / full_seconds - 1), 0.0)
    return rate, tile


# --------------------------------------------------------------------------------------------
# between processes: gloo loopback and the exchange cost
# --------------------------------------------------------------------------------------------
def _pingpong(
    rank: int, init_file: str, sizes: list[int], repeats: int, results: Queue[Any]
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    one_way = []
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
        one_way.append(best)
    if rank == 0:
        results.put(one_way)
    dist.destroy_process_group()


def _sync_worker(
    rank: int,
    init_file: str,
    world: int,
    readings: tuple[tuple[int, int], ...],
    results: Queue[Any],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    message = torch.zeros(1024)
    incoming = torch.empty_like(message)

    def timed(matrix: torch.Tensor, iterations: int, exchange: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            torch.mm(matrix, matrix)
            if exchange:
                ops = [
                    dist.P2POp(dist.isend, message, (rank + 1) % world),
                    dist.P2POp(dist.irecv, incoming, (rank - 1) % world),
                ]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
        dist.barrier()
        return time.perf_counter() - start

    intervals = []
    for size, iterations in readings:
        matrix = torch.randn(size, size)
        timed(matrix, iterations, True)  # warm-up
        alone = min(timed(matrix, iterations, False) for _ in range(2))
        synced = min(timed(matrix, iterations, True) for _ in range(2))
        intervals.append((max(synced - alone, 0.0) / iterations, alone / iterations))
    results.put((rank, intervals))
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
        intervals
        for _, intervals in run_ranks(
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


def measure_sync_curve(ranks: int, *, readings: int = 3) -> tuple[float, float]:
    """(s0, c) of `fit_sync_jitter` through the exchange's cost after each compute of SYNC_RUNS,
    each the median of `readings` runs (one run in three can read several times the others on
    a shared machine)."""
    taken = [measure_sync_intervals(ranks, SYNC_RUNS) for _ in range(readings)]
    short, long = (
        (statistics.median(r[i][0] for r in taken), statistics.median(r[i][1] for r in taken))
        for i in range(2)
    )
    return fit_sync_jitter(short, long)


def measure_loopback(
    sizes: tuple[int, ...] = LOOPBACK_SIZES, repeats: int = 5, timeout_s: float = 120.0
) -> tuple[float, float]:
    """(bytes/s, latency s) of gloo point-to-point between two processes over 127.0.0.1: the
    least-squares line through the best one-way time at each message size."""
    (times,) = run_ranks(
        _pingpong, 2, (list(sizes), repeats), 1, timeout_s, "gloo loopback measurement"
    )
    bandwidth, latency = fit_line(sizes, times)
    return bandwidth, max(latency, 1e-6)


# --------------------------------------------------------------------------------------------
# the real model's step
# --------------------------------------------------------------------------------------------
def _model_step_seconds(model: ModelSpec, seq: int, repeats: int, threads: int = 0) -> float:
    """Best time of the trainer's own model (forward, backward, AdamW step) at `seq` tokens,
    with `threads` threads in this process (0: every core)."""
    import torch

    from ctxlaunch.runtime.modeling.model import Transformer

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

    return best_seconds(step, repeats)


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
    (short, long), (residual_short, residual_long) = lengths, residual
    elementwise_short, elementwise_long = modelled_elementwise
    per_token = (residual_long - residual_short) / (long - short)
    modelled_per_token = (elementwise_long - elementwise_short) / (long - short)
    rate = calibration.memory_bytes_per_second / ranks
    if per_token > 0.05 * modelled_per_token:  # a slope lost in noise keeps the copy rate
        rate *= modelled_per_token / per_token
    fixed = max(residual_short - max(per_token, 0.0) * short, 0.0)
    return fixed, rate


# --------------------------------------------------------------------------------------------
# the whole measurement
# --------------------------------------------------------------------------------------------
def measure(
    *,
    heads: int = 4,
    head_dim: int = 32,
    seq: int = 2048,
    dtype: str = "fp32",
    repeats: int = 5,
    sizes: tuple[int, ...] = LOOPBACK_SIZES,
    model: ModelSpec | None = None,
    sync_ranks: tuple[int, ...] = (2, 4),
    attention_seq: int | None = None,
    attention_ramp_seqs: tuple[int, int] | None = None,
    sync_readings: int = 3,
    rate_readings: int = 3,
    show_progress: bool = False,
) -> Calibration:
    """Every constant the step-time model needs on this CPU; `model` (a ModelSpec, default the
    tiny preset) is what the matmul rate, the elementwise rate and the per-micro-batch overhead
    are measured on. Attention is measured on one block of `attention_seq` tokens (default
    `seq`) with no length ramp; or, given `attention_ramp_seqs` (two lengths, e.g.
    ATTENTION_RAMP_SEQS), on both and fitted to a rate and a ramp (`fit_ramp`), with all cores
    and with one thread. The ramp is not the default: on a machine shared with other work the
    all-core rate can move more between two readings minutes apart than the ramp it would fit,
    and the one-thread kernel barely ramps over these lengths. Each exchange cost is the median
    of `sync_readings` runs. Each compute rate, and the model's fixed cost and elementwise rate,
    is the median of `rate_readings` readings taken in turn (all cores, one thread, all cores,
    ...), so a minute of load elsewhere moves one reading, not the profile: a single low reading
    would slow every predicted step in proportion (BENCHMARKS.md, step-time model: the CPU
    calibration's choices). `show_progress` reports each finished stage on stderr
    (runtime/progress.py)."""
    from ctxlaunch.contract.spec import ModelSpec

    model = model or ModelSpec.model_validate({"preset": "tiny", "dtype": dtype})
    common: dict[str, Any] = dict(
        heads=heads,
        head_dim=head_dim,
        seq=seq,
        dtype=dtype,
        repeats=repeats,
        projections=block_projections(model),
    )
    ramp_seqs = None if attention_seq else attention_ramp_seqs
    # The stages, in order: compute rates (all cores, one thread) per reading, the loopback,
    # the model's residual (all cores, one thread) per reading, an exchange curve per rank count.
    plan = (
        ["compute, all cores", "compute, one thread"] * rate_readings
        + ["gloo loopback"]
        + ["model step, all cores", "model step, one thread"] * rate_readings
        + [f"exchange, {n} ranks" for n in sync_ranks]
    )
    with (
        Progress("calibrate: measurements", total=len(plan))
        if show_progress
        else contextlib.nullcontext()
    ) as progress:
        return _measure_stages(
            common,
            model,
            attention_seq,
            ramp_seqs,
            Stages(progress, plan),
            repeats=repeats,
            sizes=sizes,
            sync_ranks=sync_ranks,
            sync_readings=sync_readings,
            rate_readings=rate_readings,
        )


class Stages:
    """The calibration's stages as they end, reported with the time left: each stage still to
    come takes as long as the last one of its kind took here, or the mean of those done where
    none of its kind has run yet (its own first readings, never a figure from another
    machine)."""

    def __init__(self, progress: Progress | None, plan: list[str]) -> None:
        self.progress = progress
        self.plan = plan
        self.done: list[tuple[str, float]] = []
        self._since = time.monotonic()

    def seconds_left(self) -> float:
        """The estimate of the stages still to come."""
        took = dict(self.done)
        mean = sum(seconds for _, seconds in self.done) / len(self.done) if self.done else 0.0
        return sum(took.get(note, mean) for note in self.plan[len(self.done) :])

    def __call__(self, note: str, value: Any) -> Any:
        """`value`, measured: the stage `note` has ended."""
        now = time.monotonic()
        self.done.append((note, now - self._since))
        self._since = now
        if self.progress is not None:
            from ctxlaunch.perf.accounting import duration

            left = self.seconds_left()
            self.progress.advance(note=f"{note}; about {duration(left)} left" if left > 0 else note)
        return value


def _measure_stages(
    common: dict[str, Any],
    model: ModelSpec,
    attention_seq: int | None,
    ramp_seqs: tuple[int, int] | None,
    staged: Stages,
    *,
    repeats: int,
    sizes: tuple[int, ...],
    sync_ranks: tuple[int, ...],
    sync_readings: int,
    rate_readings: int,
) -> Calibration:
    """`measure`'s measurements, each stage reported as it ends (`staged`)."""
    rounds = [
        (
            staged("compute, all cores", _compute_rates(common, 0, attention_seq, ramp_seqs)),
            staged("compute, one thread", _compute_rates(common, 1, attention_seq, ramp_seqs)),
        )
        for _ in range(rate_readings)
    ]
    matmul, attention, ramp, tile, copy = median_each([r[0] for r in rounds])
    matmul_1, attention_1, ramp_1, _, _ = median_each([r[1] for r in rounds])
    bandwidth, latency = staged("gloo loopback", measure_loopback(sizes=sizes, repeats=repeats))
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
        host=host_signature(),
        trust={
            "readings": {
                "matmul, all cores": [r[0][0] for r in rounds],
                "attention, all cores": [r[0][1] for r in rounds],
                "matmul, one thread": [r[1][0] for r in rounds],
                "attention, one thread": [r[1][1] for r in rounds],
            }
        },
    )
    return _with_model_and_sync(
        calibration, model, repeats, rate_readings, sync_ranks, sync_readings, staged
    )


def _compute_rates(
    common: dict[str, Any],
    threads: int,
    attention_seq: int | None,
    ramp_seqs: tuple[int, int] | None,
) -> tuple[float, float, float, float, float]:
    """(matmul, attention rate, ramp L0, causal tile, copy) with `threads` threads (0: every
    core): attention on one block of `attention_seq` tokens, or on both `ramp_seqs` and fitted
    to a rate and a ramp."""
    if ramp_seqs is None:
        matmul, attention, tile, copy = measure_compute(
            **common, threads=threads, attention_seq=attention_seq
        )
        return matmul, attention, 0.0, tile, copy
    short, long = ramp_seqs
    _, short_rate, _, _ = measure_compute(**common, threads=threads, attention_seq=short)
    matmul, long_rate, tile, copy = measure_compute(**common, threads=threads, attention_seq=long)
    rate, ramp = fit_ramp(short, short_rate, long, long_rate)
    return matmul, rate, ramp, tile, copy


def _with_model_and_sync(
    calibration: Calibration,
    model: ModelSpec,
    repeats: int,
    rate_readings: int,
    sync_ranks: tuple[int, ...],
    sync_readings: int,
    staged: Stages | None = None,
) -> Calibration:
    """`calibration` (its compute and link rates measured) completed with the real model's fixed
    cost and elementwise rate, all cores and one thread, each the median of `rate_readings`
    readings, and the exchange cost curve at each rank count of `sync_ranks`."""
    staged = staged or Stages(None, [])
    residuals = [
        (
            staged(
                "model step, all cores",
                measure_model_residual(model, calibration, repeats=repeats),
            ),
            staged(
                "model step, one thread",
                measure_model_residual(model, calibration, repeats=repeats, threads=1),
            ),
        )
        for _ in range(rate_readings)
    ]
    overhead, elementwise = median_each([r[0] for r in residuals])
    overhead_1, elementwise_1 = median_each([r[1] for r in residuals])
    curves = {
        str(n): staged(f"exchange, {n} ranks", measure_sync_curve(n, readings=sync_readings))
        for n in sync_ranks
    }
    return dataclasses.replace(
        calibration,
        microbatch_overhead_seconds=overhead,
        elementwise_bytes_per_second=elementwise,
        sync_seconds={ranks: s0 for ranks, (s0, _) in curves.items()},
        sync_jitter={ranks: growth for ranks, (_, growth) in curves.items()},
        one_thread={
            **(calibration.one_thread or {}),  # the compute rates measured with one thread
            "elementwise": elementwise_1,
            "microbatch_overhead": overhead_1,
        },
    )
