"""What a training rank reports: step metrics, MFU in both conventions, memory against capacity
and the planner's prediction, exposed ring communication, and OOM events, to Prometheus from
every rank and, from rank 0, to the experiment trackers (`trackers`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ctxlaunch.contract.hardware import GiB
from ctxlaunch.contract.rundir import default_run_dir
from ctxlaunch.perf.accounting import Prediction, job_prediction
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.memory import estimate
from ctxlaunch.perf.moecost import routed_load
from ctxlaunch.runtime.records import peak_memory_bytes
from ctxlaunch.runtime.telemetry.exporter import Exporter, identity_from_spec
from ctxlaunch.runtime.telemetry.trackers import Trackers, eval_series, step_series

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.cp.kernel_choice import KernelChoice
    from ctxlaunch.planning.replan import Decision
    from ctxlaunch.runtime.records import EvalResult, StepMetrics


def measure_cpu_peak_flops(dtype: torch.dtype, size: int = 1024, repeats: int = 8) -> float:
    """A CPU has no data-sheet peak here: measure it, as a data sheet states it, per core times
    cores. One core's rate is the best of a few square matmuls on one thread, timed by that
    thread's own CPU clock, so a busy machine that takes the core away mid-matmul does not lower
    it (a wall-clock reading did, by the share the core was away, and MFU then read above 1);
    times the threads this process computes with."""
    threads = torch.get_num_threads()
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.set_num_threads(1)  # the matmul then runs on this thread, which time.thread_time times
    try:
        torch.mm(a, b)  # warm-up: packing, the kernel's first dispatch
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            torch.mm(a, b)
            best = min(best, time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return threads * 2.0 * size**3 / max(best, 1e-9)


def peak_flops(spec: JobSpec, device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s per GPU, where the figure comes from)."""
    bf16 = spec.model.dtype == "bf16"
    if device.type == "cuda":
        gpu = spec.cluster.gpu_info
        return (gpu.peak_bf16_flops if bf16 else gpu.peak_fp32_flops), "gpu_table"
    return measure_cpu_peak_flops(torch.bfloat16 if bf16 else torch.float32), "measured_cpu_matmul"


def predicted_step_seconds(spec: JobSpec) -> float:
    """The step-time model's step for this job: the GPU and fabric tables, or on the CPU the
    constants measured by `ctxlaunch calibrate` (the tables' placeholders without them)."""
    return job_prediction(spec).step_seconds


def device_capacity_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_stats(device: torch.device) -> tuple[int, int, int]:
    """(peak allocated, peak reserved, allocator retries) of this rank."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return (
            int(stats.get("allocated_bytes.all.peak", 0)),
            int(stats.get("reserved_bytes.all.peak", 0)),
            int(stats.get("num_alloc_retries", 0)),
        )
    peak = peak_memory_bytes(device)
    return peak, peak, 0


class TrainingTelemetry:
    """The trainer's observer: `on_step(metrics)` each step, `on_eval(result)` each evaluation,
    `on_oom(...)` on an OOM, `close(exit_code)` at the end. Rank 0 also starts the experiment
    trackers of spec.telemetry.trackers, their defaults under `run_dir` (default: the job's
    default run directory)."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        rank: int,
        local_rank: int,
        device: torch.device,
        log: Callable[[str], None] | None = None,
        run_dir: Path | None = None,
    ):
        telemetry = spec.telemetry
        self.spec, self.device, self.rank = spec, device, rank
        self.exporter = Exporter(
            identity_from_spec(spec, rank, local_rank),
            mode=telemetry.prometheus,
            port=telemetry.port,
            bind_address=telemetry.bind_address_for(spec.cluster.target),
            pushgateway_url=telemetry.pushgateway_url,
            push_interval_seconds=telemetry.push_interval_seconds,
            log=log,
        )
        self.peak, source = peak_flops(spec, device)
        self.exporter.set("ctxlaunch_peak_flops_per_second", self.peak, source=source)
        self.capacity = device_capacity_bytes(device)
        self.exporter.set("ctxlaunch_memory_capacity_bytes", self.capacity)
        layout = Layout.from_spec(spec)
        self.prediction = estimate(spec.model, layout, spec.cluster.gpu_info)
        self.planned_load = routed_load(spec.model, layout)
        """The routing load the planner admitted (perf.moecost.routed_load)."""
        self.job_prediction: Prediction = job_prediction(spec)
        """What the job is predicted to do (the step, MFU, tokens/s, peak memory), which the
        trainer's metrics, its summary and `status` read the measured figures against."""
        self._set_prediction(self.job_prediction)
        self.exporter.set("ctxlaunch_target_steps", spec.training.steps)
        self._retries_seen = 0
        self.trackers = Trackers([])
        if rank == 0 and telemetry.trackers:
            identity = self.exporter.identity
            self.trackers = Trackers.start(
                spec,
                run_dir or default_run_dir(spec.name),
                run_name=spec.name if identity.run == "manual" else f"{spec.name}-{identity.run}",
                say=log,
            )

    def _set_prediction(self, prediction: Prediction) -> None:
        """The prediction as series, beside the measured ones from the first scrape."""
        exporter = self.exporter
        exporter.set("ctxlaunch_planner_predicted_peak_bytes", self.prediction.total)
        exporter.set("ctxlaunch_predicted_step_duration_seconds", prediction.step_seconds)
        exporter.set("ctxlaunch_predicted_step_error_ratio", prediction.expected_error)
        exporter.set(
            "ctxlaunch_predicted_tokens_per_second_per_gpu", prediction.tokens_per_second_per_gpu
        )
        for convention, value in prediction.mfu.items():
            exporter.set("ctxlaunch_predicted_mfu_ratio", value, convention=convention)
        exporter.set(
            "ctxlaunch_estimated_remaining_seconds",
            prediction.step_seconds * self.spec.training.steps,
        )

    def attention_kernel(self, choice: KernelChoice) -> None:
        """Export the attention kernel the run chose (`fastpath.choose_attention_kernel`)."""
        self.exporter.set(
            "ctxlaunch_attention_kernel_info", 1, kernel=choice.kernel, chosen_by=choice.chosen_by
        )

    def on_step(self, metrics: StepMetrics) -> None:
        """Export one step's metrics."""
        exporter = self.exporter
        exporter.set("ctxlaunch_step_duration_seconds", metrics.step_seconds)
        exporter.set("ctxlaunch_tokens_per_second_per_gpu", metrics.tokens_per_second_per_gpu)
        mfu = {}
        for convention, tflops in (
            ("full", metrics.model_tflops_per_gpu_full),
            ("causal", metrics.model_tflops_per_gpu_causal),
        ):
            mfu[convention] = tflops * 1e12 / self.peak
            exporter.set(
                "ctxlaunch_model_flops_per_second_per_gpu", tflops * 1e12, convention=convention
            )
            exporter.set("ctxlaunch_mfu_ratio", mfu[convention], convention=convention)
        exporter.set("ctxlaunch_loss", metrics.loss)
        allocated, reserved, retries = memory_stats(self.device)
        exporter.set("ctxlaunch_memory_peak_allocated_bytes", allocated)
        exporter.set("ctxlaunch_memory_peak_reserved_bytes", reserved)
        if retries > self._retries_seen:
            exporter.inc("ctxlaunch_allocator_retries_total", retries - self._retries_seen)
            self._retries_seen = retries
        exporter.set("ctxlaunch_cp_exposed_comm_seconds", metrics.exposed_comm_seconds)
        exporter.set("ctxlaunch_cp_attention_balance_ratio", metrics.attention_balance)
        if self.spec.model.moe is not None:
            self._experts(metrics)
        exporter.set("ctxlaunch_last_step", metrics.step)
        if metrics.remaining_seconds is not None:
            exporter.set("ctxlaunch_estimated_remaining_seconds", metrics.remaining_seconds)
        exporter.set("ctxlaunch_last_step_timestamp_seconds", time.time())
        if self.trackers.logs_step(metrics.step):
            series = step_series(
                metrics,
                mfu=mfu,
                peak_allocated_bytes=allocated,
                peak_reserved_bytes=reserved,
                predicted_peak_bytes=self.prediction.total,
            )
            self.trackers.log(series, metrics.step)

    def _experts(self, metrics: StepMetrics) -> None:
        """A mixture of experts' routing of the step: expert load per layer and its highest,
        the busiest EP rank's load against the planned one, the auxiliary loss, the drops."""
        exporter = self.exporter
        for layer, load in enumerate(metrics.expert_load_layers):
            exporter.set("ctxlaunch_moe_expert_load_ratio", load, layer=str(layer))
        exporter.set("ctxlaunch_moe_expert_load_ratio", metrics.expert_load, layer="max")
        exporter.set("ctxlaunch_moe_ep_rank_load_ratio", metrics.expert_rank_load)
        exporter.set("ctxlaunch_moe_planned_load_ratio", self.planned_load)
        exporter.set("ctxlaunch_moe_aux_loss", metrics.aux_loss)
        if metrics.tokens_dropped:
            exporter.inc("ctxlaunch_moe_tokens_dropped_total", metrics.tokens_dropped)

    def on_eval(self, result: EvalResult) -> None:
        """Export an evaluation's loss per context-length bucket and passkey retrieval."""
        exporter = self.exporter
        for bucket in result.buckets:
            if bucket.tokens:
                exporter.set(
                    "ctxlaunch_eval_loss", bucket.loss, bucket=f"{bucket.start}-{bucket.stop}"
                )
        exporter.set("ctxlaunch_eval_loss", result.loss, bucket="all")
        for cell in result.passkey:
            exporter.set(
                "ctxlaunch_passkey_retrieval_ratio",
                cell.retrieved / cell.trials,
                length=str(cell.length),
                depth=f"{cell.depth:g}",
            )
        if result.step is not None:
            exporter.set("ctxlaunch_eval_step", result.step)
            if self.trackers.active:
                self.trackers.log(eval_series(result), result.step)

    def on_oom(self, step: int) -> str:
        """Record and push an OOM at `step`; returns the line for the log: the prediction and
        what the planner says would fit."""
        from ctxlaunch.planning.plan import plan_job

        report = plan_job(self.spec)
        fits = []
        if report.smallest_fitting_cp is not None:
            o = report.smallest_fitting_cp
            fits.append(f"parallel.cp = {o.dims.cp} ({o.gpus} GPUs)")
        fits += [s.describe() for s in report.suggestions[:2]]
        would_fit = " or ".join(fits) if fits else "nothing the planner can vary"
        exporter = self.exporter
        exporter.inc("ctxlaunch_oom_events_total")
        exporter.set(
            "ctxlaunch_oom_event_info",
            1,
            step=str(step),
            predicted_peak_bytes=str(self.prediction.total),
            capacity_bytes=str(self.capacity),
            would_fit=would_fit,
        )
        exporter.push()  # now: the process is about to exit
        return (
            f"out of memory on rank {self.rank} at step {step}: the planner predicted "
            f"{self.prediction.total / GiB:.2f} GiB per rank against "
            f"{self.prediction.capacity / GiB:.2f} GiB; would fit with {would_fit}"
        )

    def replanned(self, decision: Decision) -> None:
        """Export the re-plan (training.heal) that started this run, and push it now."""
        entry = decision.entry
        previous = decision.previous
        from_layout = previous.layout if previous is not None else "the spec's own"
        self.exporter.inc("ctxlaunch_replans_total", why=decision.why)
        self.exporter.set(
            "ctxlaunch_replan_info",
            1,
            why=decision.why,
            from_layout=from_layout,
            to_layout=entry.layout,
            step=str(entry.step),
        )
        self.exporter.set("ctxlaunch_replan_timestamp_seconds", time.time(), why=decision.why)
        self.exporter.push()

    def close(self, exit_code: int | None = None) -> None:
        """Stop the exporter and close the trackers (the run ended with `exit_code`)."""
        self.exporter.close()
        self.trackers.close(exit_code)
