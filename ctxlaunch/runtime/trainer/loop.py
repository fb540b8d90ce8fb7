"""The training loop: one named call per step, checkpoints, resume, and a clean stop on a
preemption signal."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ctxlaunch.contract import events, exitcodes
from ctxlaunch.cp import ring_rank_areas
from ctxlaunch.cp.comm import exposed_comm_seconds
from ctxlaunch.perf.accounting import Prediction, duration
from ctxlaunch.perf.flops import flops_per_token
from ctxlaunch.runtime.checkpointing import checkpoint, checkpoint_integrity
from ctxlaunch.runtime.data.batches import Batches, MicroBatch, make_source
from ctxlaunch.runtime.modeling import pointwise
from ctxlaunch.runtime.modeling.model import Transformer
from ctxlaunch.runtime.modeling.moe import summarise
from ctxlaunch.runtime.parallel.context import ParallelContext
from ctxlaunch.runtime.parallel.parallelize import parallelize_job
from ctxlaunch.runtime.progress import StepClock
from ctxlaunch.runtime.records import StepMetrics, peak_memory_bytes
from ctxlaunch.runtime.trainer import fastpath, faults, stopsignal
from ctxlaunch.runtime.trainer.engines import Engine, make_engine

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.records import EvalResult


class Trainer:
    """Builds the model, the engine and the data for one rank, and runs the steps."""

    def __init__(
        self,
        spec: JobSpec,
        ctx: ParallelContext,
        device: torch.device,
        run_dir: Path | None = None,
        log: Callable[[str], None] = print,
    ):
        self.spec, self.ctx, self.device, self.log = spec, ctx, device, log
        self.run_dir = run_dir
        training = spec.training
        torch.manual_seed(training.seed)
        pointwise.set_compiled(fastpath.resolve(training.compile, device))
        with torch.device("meta"):  # parallelize materialises only this rank's share
            model = Transformer.from_spec(spec.model)
        parts = parallelize_job(model, spec, ctx=ctx, device=device)
        self.engine: Engine = make_engine(parts, spec, ctx, device)
        self.batches = Batches(
            make_source(training.data, spec.model.vocab, training.seq_len, training.seed),
            seq_len=training.seq_len,
            micro_batch=training.micro_batch,
            global_batch=spec.global_batch,
            dp=ctx.dims.dp,
            dp_rank=ctx.dp_rank,
            cp=ctx.dims.cp,
            cp_rank=ctx.cp_rank,
            cp_sharding=ctx.dims.cp_sharding,
            document_mask=training.data.document_mask,
            restart_positions=training.data.restart_positions,
        )
        self.evaluator = None
        if training.eval.interval:
            from ctxlaunch.runtime.evaluation.evaluator import Evaluator

            self.evaluator = Evaluator(spec, ctx, parts.model, device)
        self.tokens_per_gpu = spec.tokens_per_step / ctx.world_size
        self._routing = parts.model.routing
        """A mixture-of-experts model's router records (moe.Routing), None for a dense one."""
        self.flops_per_token = {
            c: flops_per_token(spec.model, training.seq_len, c) for c in ("full", "causal")
        }
        self.step = 0
        self.phase = "start"
        """Where the rank is in the run (an out-of-memory's event names it): start, loading the
        checkpoint, forward/backward, optimizer, checkpoint, evaluation."""
        self._stop_agreed = False
        self.fault = faults.from_env()
        self.damaged_steps: frozenset[int] = frozenset()
        """Committed steps resume found damaged and skipped: never pruned."""
        self.prediction: Prediction | None = None
        """What the planner and the step-time model predict for this job (main sets it), which
        each step's metrics and the summary carry beside the measured figures."""

    @property
    def predicted_step_seconds(self) -> float | None:
        return self.prediction.step_seconds if self.prediction is not None else None

    # -- one step ------------------------------------------------------------------------------
    def train_step(self, on_gradients: Callable[[Engine], object] | None = None) -> StepMetrics:
        """Forward and backward over the step's micro-batches, average the gradients over the
        job, update. `on_gradients(engine)` runs between the two (checks read gradients)."""
        self.phase = "forward/backward"
        if self.fault is not None:
            self.fault.maybe_fire(self.ctx.rank, self.step + 1)
        start = time.perf_counter()
        exposed_before = exposed_comm_seconds()
        batches = [self.batches.get(self.step, micro) for micro in range(self.spec.grad_accum)]
        losses = self.engine.run_micro_batches(batches, self._predicted_tokens(batches))
        routing = (
            self._routing.step_summary(self._routing.drain(), len(batches))
            if self._routing
            else None
        )
        self.engine.finish_gradients()
        if on_gradients is not None:
            on_gradients(self.engine)
        self.phase = "optimizer"
        norm = self.engine.apply()
        lr = self.engine.lr()
        local = (
            torch.stack(losses).float().mean() if losses else torch.zeros((), device=self.device)
        )
        # The step's one host synchronisation: the loss and the gradient norm read together.
        host = torch.stack(
            [
                local.detach().float(),
                torch.as_tensor(norm, dtype=torch.float32, device=local.device),
            ]
        ).cpu()
        grad_norm = float(host[1])
        loss, self._stop_agreed, summed = self._reduce(host[0], routing)
        seconds = time.perf_counter() - start
        self.step += 1
        tokens_per_second = self.tokens_per_gpu / seconds
        experts = (
            summarise(
                summed,
                self.spec.model.moe.experts,
                self.ctx.dims.ep,
                self.ctx.world_size // self.ctx.dims.pp,
            )
            if summed is not None and self.spec.model.moe is not None
            else {}
        )
        return StepMetrics(
            step=self.step,
            loss=loss,
            step_seconds=seconds,
            tokens_per_second_per_gpu=tokens_per_second,
            model_tflops_per_gpu_full=tokens_per_second * self.flops_per_token["full"] / 1e12,
            model_tflops_per_gpu_causal=tokens_per_second * self.flops_per_token["causal"] / 1e12,
            peak_memory_bytes=peak_memory_bytes(self.device),
            lr=lr,
            grad_norm=grad_norm,
            exposed_comm_seconds=exposed_comm_seconds() - exposed_before,
            attention_balance=self._attention_balance(batches),
            **experts,
        )

    def _attention_balance(self, batches: list[MicroBatch]) -> float:
        """The busiest over the mean attention area of this rank's CP group in the step's
        micro-batches (pure arithmetic on the batches' documents; no communication)."""
        ctx = self.ctx
        if ctx.dims.cp == 1:
            return 1.0
        totals: list[int] = []
        for batch in batches:
            areas = ring_rank_areas(
                batch.documents,
                self.spec.training.seq_len,
                ctx.dims.cp,
                ctx.dims.cp_sharding,
                ctx.dims.ulysses_degree,
                batch=batch.tokens.size(0),
            )
            totals = [a + b for a, b in zip(totals, areas, strict=True)] if totals else list(areas)
        mean = sum(totals) / len(totals)
        return max(totals) / mean if mean else 1.0

    def _predicted_tokens(self, batches: list[MicroBatch]) -> int:
        """The step's predicted-token count over every DP x CP rank and micro-batch (one
        all-reduce over the ranks holding the same weights; TP and PP peers count the same
        tokens in their own groups)."""
        local = sum(batch.predicted_tokens for batch in batches)
        if self.ctx.dp_cp_group is None:
            return local
        count = torch.tensor(local, dtype=torch.int64)
        dist.all_reduce(count, group=self.ctx.dp_cp_group)
        return int(count)

    def _reduce(
        self, loss: torch.Tensor, routing: torch.Tensor | None = None
    ) -> tuple[float, bool, torch.Tensor | None]:
        """The job's mean loss (from this rank's, a CPU tensor), whether any rank got a
        stop signal, and a mixture-of-experts model's routing summary summed over the job
        (`moe.Routing.step_summary`), in one collective.
        Every rank that computes a loss (all of them, or the last pipeline stage's) holds the
        mean of its micro-batches' losses, each its summed loss over P / (DP x CP x
        grad_accum) (P the step's predicted tokens, see engines.py), so their sum over the
        DP x CP x TP loss ranks divided by their number is (sum of all losses) / P; other
        ranks add 0."""
        stop = stopsignal.received() is not None
        if not dist.is_initialized() or self.ctx.world_size == 1:
            return float(loss), stop, routing
        packed = torch.cat(
            [
                loss.detach().to(torch.float64).reshape(1),
                torch.tensor([float(stop)], dtype=torch.float64),
                routing if routing is not None else torch.zeros(0, dtype=torch.float64),
            ]
        )
        dist.all_reduce(packed)
        return (
            float(packed[0]) / (self.ctx.world_size // self.ctx.dims.pp),
            bool(packed[1] > 0),
            packed[2:] if routing is not None else None,
        )

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str | None:
        return self.spec.training.checkpoint.dir

    def resume(self) -> int:
        """Load the newest committed checkpoint, if any; returns the step to start from."""
        directory = self.checkpoint_dir
        if directory is None:
            return 0
        steps = checkpoint.committed_steps(directory)
        for step in reversed(steps):
            path = checkpoint.step_dir(directory, step)
            reason = checkpoint.damage(path, self.ctx.rank)
            if reason is None:
                self.phase = "loading the checkpoint"
                self.engine.load(path)
                self.step = step
                self.log(f"ctxlaunch: resumed from {path}")
                return step
            # Kept, never pruned: a person decides what to do with it.
            self.damaged_steps = self.damaged_steps | {step}
            self.log(f"ctxlaunch: skipped checkpoint {path}: {reason}; trying an older one")
            if self.run_dir is not None and self.ctx.rank == 0:
                events.append_event(
                    self.run_dir,
                    events.CHECKPOINT_SKIPPED,
                    step=step,
                    path=str(path),
                    reason=reason,
                )
        if steps:
            raise checkpoint_integrity.CheckpointDamaged(
                f"every committed checkpoint in training.checkpoint.dir {directory} differs "
                "from what was committed (see the lines above); move them aside to start over"
            )
        return 0

    def save_checkpoint(self) -> None:
        if self.checkpoint_dir is None:
            return
        path = checkpoint.step_dir(self.checkpoint_dir, self.step)
        self.phase = "checkpoint"
        try:
            self.engine.save(path)
        except (Exception, CheckpointException) as exc:  # the latter is a BaseException
            if not checkpoint.out_of_space(exc, self.checkpoint_dir):
                raise
            # Free what was written: without its marker it is never resumed from anyway.
            shutil.rmtree(path, ignore_errors=True)
            latest = checkpoint.latest_step(self.checkpoint_dir)
            raise checkpoint.CheckpointWriteError(
                f"checkpoint {path} not written: the disk is full (no space left on device; "
                f"{checkpoint.free_mib(self.checkpoint_dir):.1f} MiB free in "
                f"training.checkpoint.dir {self.checkpoint_dir}); "
                + (
                    f"the newest complete checkpoint, step {latest}, is intact and a rerun "
                    f"resumes from it"
                    if latest is not None
                    else "no complete checkpoint yet"
                )
            ) from None
        if self.fault is not None:
            self.fault.maybe_fire_in_save(self.ctx.rank, self.step)
        # The resolved model section travels with the weights: `ctxlaunch export` needs it.
        checkpoint.commit(
            self.checkpoint_dir,
            self.step,
            self.ctx.rank,
            self.spec.training.checkpoint.keep,
            spare=self.damaged_steps,
            info={
                "job": self.spec.name,
                "model": self.spec.model.model_dump(mode="json"),
                "seq_len": self.spec.training.seq_len,
            },
        )
        self.log(f"ctxlaunch: checkpoint {path}")
        if self.run_dir is not None:
            events.append_event(self.run_dir, events.CHECKPOINT, step=self.step, path=str(path))

    # -- preemption ----------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGUSR1 (Slurm's warning before a time limit) and SIGTERM (preemption): finish the
        step in hand, checkpoint, exit PREEMPTED so the job is requeued. main() installs them
        earlier still; a signal received before this point stops the run after its first step."""
        stopsignal.install()

    # -- the run -------------------------------------------------------------------------------
    def run(
        self,
        observers: Iterable[Callable[[StepMetrics], object]] = (),
        eval_observers: Iterable[Callable[[EvalResult], object]] = (),
    ) -> int:
        """Train to the spec's step count (or until a stop signal); returns the exit status.
        Every training.eval.interval steps, evaluate on the held-out data."""
        training = self.spec.training
        self.install_signal_handlers()
        self.resume()
        history: list[StepMetrics] = []
        clock = StepClock(training.steps, self.predicted_step_seconds)
        while self.step < training.steps:
            metrics = self.train_step()
            clock.record(metrics.step_seconds)
            metrics = dataclasses.replace(
                metrics,
                steps=training.steps,
                progress=clock.progress(metrics.step),
                remaining_seconds=clock.remaining_seconds(metrics.step),
                predicted_step_seconds=self.predicted_step_seconds,
            )
            history.append(metrics)
            for observer in observers:
                observer(metrics)
            if metrics.step % training.log_interval == 0 or metrics.step == training.steps:
                self._log_step(metrics)
            if self.evaluator is not None and metrics.step % training.eval.interval == 0:
                self.phase = "evaluation"
                result = self.evaluator.run(metrics.step)
                self._log_eval(result)
                for eval_observer in eval_observers:
                    eval_observer(result)
            # A stop signal during the last step stops nothing: the run is done, not requeued.
            stop = self._stop_agreed and self.step < training.steps
            if (
                stop
                or metrics.step % training.checkpoint.interval == 0
                or metrics.step == training.steps
            ):
                self.save_checkpoint()
            if stop:
                if self.run_dir is not None:
                    events.append_event(self.run_dir, events.STOP_SIGNAL, step=self.step)
                self.log(
                    f"ctxlaunch: stop signal received; checkpointed at step {self.step}, "
                    f"exiting {exitcodes.PREEMPTED} to be requeued"
                )
                return exitcodes.PREEMPTED
        self._summarise(history)
        return exitcodes.OK

    def _log_step(self, metrics: StepMetrics) -> None:
        left = (
            f"  {metrics.progress:.0%}, {duration(metrics.remaining_seconds)} left"
            if metrics.remaining_seconds is not None
            else ""
        )
        self.log(
            f"step {metrics.step}/{self.spec.training.steps}{left}  loss {metrics.loss:.4f}  "
            f"step {metrics.step_seconds:.2f} s  {metrics.tokens_per_second_per_gpu:,.0f} tokens/s/GPU  "
            f"{metrics.model_tflops_per_gpu_full:.3f} TFLOP/s/GPU (full)  "
            f"peak {metrics.peak_memory_bytes / 2**30:.2f} GiB  lr {metrics.lr:.2e}"
            + (
                f"  attention busiest/mean {metrics.attention_balance:.2f}"
                if self.ctx.dims.cp > 1
                else ""
            )
            + (
                f"  aux {metrics.aux_loss:.4f}  experts busiest/mean {metrics.expert_load:.2f}"
                + (f" (EP ranks {metrics.expert_rank_load:.2f})" if self.ctx.dims.ep > 1 else "")
                + (f"  dropped {metrics.tokens_dropped:,}" if metrics.tokens_dropped else "")
                if self._routing is not None
                else ""
            )
        )
        if self.run_dir is not None and self.ctx.rank == 0:
            with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(asdict(metrics)) + "\n")
            events.append_event(self.run_dir, events.STEP, step=metrics.step, loss=metrics.loss)

    def _log_eval(self, result: EvalResult) -> None:
        self.log(f"eval step {result.step}: " + "; ".join(result.lines()))
        if self.run_dir is not None and self.ctx.rank == 0:
            with open(self.run_dir / "eval.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(result.to_dict()) + "\n")
            events.append_event(self.run_dir, events.EVAL, step=result.step, loss=result.loss)

    def _summarise(self, history: list[StepMetrics]) -> None:
        peak = peak_memory_bytes(self.device)
        peaks = [peak]
        if dist.is_initialized() and self.ctx.world_size > 1:
            peaks = [0] * self.ctx.world_size
            dist.all_gather_object(peaks, peak)
        if self.ctx.rank == 0 and not history:  # resumed from the final checkpoint
            self.log(
                f"ctxlaunch: done: {self.step} steps, all before this run (resumed from "
                "the final checkpoint)"
            )
        if self.ctx.rank != 0 or not history:
            return
        # The first step includes warm-up (allocations, kernel selection): leave it out.
        timed = history[1:] or history
        summary = {
            "job": self.spec.name,
            "steps": self.step,
            "final_loss": history[-1].loss,
            "first_loss": history[0].loss,
            "tokens_per_second_per_gpu": sum(m.tokens_per_second_per_gpu for m in timed)
            / len(timed),
            "step_seconds": sum(m.step_seconds for m in timed) / len(timed),
            "peak_memory_bytes_per_rank": peaks,
            "world_size": self.ctx.world_size,
            "cp": self.ctx.dims.cp,
            "cp_algorithm": self.spec.parallel.cp_algorithm,
            # Every step, warm-up included: the balance follows the data, not the timing.
            "attention_balance": sum(m.attention_balance for m in history) / len(history),
            "model_tflops_per_gpu": {
                "full": sum(m.model_tflops_per_gpu_full for m in timed) / len(timed),
                "causal": sum(m.model_tflops_per_gpu_causal for m in timed) / len(timed),
            },
            "predicted": self.prediction.to_dict() if self.prediction is not None else None,
        }
        if self._routing is not None:
            summary["aux_loss"] = history[-1].aux_loss
            summary["expert_load"] = sum(m.expert_load for m in history) / len(history)
            summary["expert_rank_load"] = max(m.expert_rank_load for m in history)
            summary["tokens_dropped"] = sum(m.tokens_dropped for m in history)
        self.log(
            f"ctxlaunch: done: {summary['steps']} steps, loss {summary['first_loss']:.4f} "
            f"-> {summary['final_loss']:.4f}, "
            f"{summary['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, peak memory per "
            f"rank: " + ", ".join(f"{p / 2**30:.2f} GiB" for p in peaks)
        )
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
