"""How gradients become updates: plain torch for ZeRO-0, DeepSpeed for ZeRO-1..3.

Both average gradients over every rank of the job (DP x CP): each rank's loss is the mean over
its own tokens, the ring and Ulysses backward passes carry each rank's contribution to the
others' K/V, so the sum of the ranks' gradients divided by DP x CP is the gradient of the mean
loss over all tokens.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch.perf.memory import (
    GRAD_BUCKET_ELEMENTS,
    ZERO3_PREFETCH_ELEMENTS,
    ZERO_BUCKET_ELEMENTS,
)
from ctxlaunch.runtime.trainer.data import MicroBatch


class Engine(Protocol):
    model: nn.Module

    def forward_backward(self, batch: MicroBatch, micro: int) -> torch.Tensor:
        """Loss of one micro-batch (detached), gradients accumulated."""

    def finish_gradients(self) -> None:
        """Average the accumulated gradients over the job (a no-op where the backward did)."""

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged, unsharded gradient of every parameter (for checks)."""

    def apply(self) -> float:
        """Clip, step the optimizer and the schedule; returns the gradient norm."""

    def lr(self) -> float: ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...


def lr_lambda(steps: int, warmup: int, min_ratio: float):  # type: ignore[no-untyped-def]
    """Linear warm-up to 1, then cosine decay to min_ratio at the last step."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        span = max(steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, never on norm gains."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, training) -> tuple[  # type: ignore[no-untyped-def]
        torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its warm-up/cosine schedule, from the spec's training section."""
    opt = training.optimizer
    optimizer = torch.optim.AdamW(param_groups(model, opt.weight_decay), lr=opt.lr,
                                  betas=tuple(opt.betas), eps=opt.eps, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(training.steps, opt.warmup_steps, opt.min_lr_ratio))
    return optimizer, scheduler


class PlainEngine:
    """ZeRO-0: every rank holds fp32 weights, gradients and Adam states; bf16 compute through
    autocast; gradients all-reduced in flat buckets after the last micro-batch."""

    def __init__(self, model: nn.Module, spec, device: torch.device):  # type: ignore[no-untyped-def]
        t = spec.training
        self.model = model.to(device)
        self.device = device
        self.grad_accum = spec.grad_accum
        self.grad_clip = t.optimizer.grad_clip
        self.autocast_dtype = torch.bfloat16 if spec.model.dtype == "bf16" else None
        self.optimizer, self.scheduler = make_optimizer(model, t)
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def forward_backward(self, batch: MicroBatch, micro: int) -> torch.Tensor:
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            loss = self.model(batch.tokens.to(self.device), batch.positions.to(self.device),
                              batch.targets.to(self.device))
        (loss / self.grad_accum).backward()
        return loss.detach()

    def finish_gradients(self) -> None:
        if self.world == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in grads:
            bucket.append(grad)
            size += grad.numel()
            if size >= GRAD_BUCKET_ELEMENTS:
                self._all_reduce(bucket)
                bucket, size = [], 0
        if bucket:
            self._all_reduce(bucket)

    def _all_reduce(self, bucket: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {name: p.grad.detach().clone() for name, p in self.model.named_parameters()}

    def apply(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _checkpoint(self):  # type: ignore[no-untyped-def]
        # The layout-independent format the TP/PP engine writes too (ctxlaunch/trainer/
        # reshard.py), so a ZeRO-0 job resumes across DP, CP, TP and PP degrees.
        from ctxlaunch.runtime.trainer.reshard import CheckpointState
        from ctxlaunch.runtime.trainer.tensor_parallel import shardings

        return CheckpointState(list(self.model.named_parameters()), self.optimizer,
                               self.scheduler, shardings(self.model), 1, None, self.device)

    def save(self, path: Path) -> None:
        self._checkpoint().save(path)

    def load(self, path: Path) -> None:
        self._checkpoint().load(path)


def deepspeed_config(spec) -> dict:  # type: ignore[no-untyped-def]
    t = spec.training
    zero: dict = {"stage": t.zero_stage}
    if t.zero_stage in (1, 2):
        zero.update(reduce_bucket_size=ZERO_BUCKET_ELEMENTS,
                    allgather_bucket_size=ZERO_BUCKET_ELEMENTS, overlap_comm=False)
    if t.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=ZERO3_PREFETCH_ELEMENTS,
                    reduce_bucket_size=ZERO_BUCKET_ELEMENTS)
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "zero_optimization": zero,
        "bf16": {"enabled": spec.model.dtype == "bf16"},
        "gradient_clipping": t.optimizer.grad_clip,
        # ZeRO with a torch optimizer (AdamW): DeepSpeed's fused Adam would compile a kernel.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def init_deepspeed(backend: str) -> None:
    """Bind DeepSpeed's comm layer to the process group torch already made."""
    # DeepSpeed compiles a shared-memory all-reduce op on first use (~75 s on CPU); gloo does
    # the job. Patch the module the name lives in (a plain import would bind a copy).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


class DeepSpeedEngine:
    """ZeRO-1..3 through `deepspeed.initialize` with a torch AdamW."""

    def __init__(self, model: nn.Module, spec, device: torch.device):  # type: ignore[no-untyped-def]
        import deepspeed

        t = spec.training
        self.device = device
        self.grad_accum = spec.grad_accum
        model = model.to(device)
        optimizer, scheduler = make_optimizer(model, t)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(spec), dist_init_required=False)
        self.model = self.engine.module

    def forward_backward(self, batch: MicroBatch, micro: int) -> torch.Tensor:
        loss = self.engine(batch.tokens.to(self.device), batch.positions.to(self.device),
                           batch.targets.to(self.device))
        self.engine.backward(loss)  # scales by 1/grad_accum itself
        if micro < self.grad_accum - 1:
            self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step count
        return loss.detach().float()

    def finish_gradients(self) -> None:
        pass  # reduced (and partitioned) inside the boundary micro-batch's backward

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        return {name: safe_get_full_grad(p).detach().float().clone()
                for name, p in self.model.named_parameters()}

    def apply(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)

    def load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(
            str(path.parent), tag=path.name, load_optimizer_states=True,
            load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {path}")


def make_engine(model: nn.Module, spec, device: torch.device) -> Engine:  # type: ignore[no-untyped-def]
    if spec.training.zero_stage == 0:
        return PlainEngine(model, spec, device)
    return DeepSpeedEngine(model, spec, device)
