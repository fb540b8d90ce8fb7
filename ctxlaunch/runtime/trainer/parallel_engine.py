"""The engine for layouts with tensor or pipeline parallelism (TP x CP x DP x PP).

Model states: ZeRO-0 keeps fp32 weights, gradients and Adam states of this rank's TP slice of
its stages; ZeRO-1/2/3 shard them over DP x CP with FSDP2 (`fully_shard` on a one-dimensional
DeviceMesh of the ranks that hold the same slice), each block a unit: stage 1 and 2 keep the
gathered weights from forward to backward (gradients and optimizer states sharded, ZeRO-2),
stage 3 re-shards them after forward. DeepSpeed stays the engine for layouts without TP and
PP: its modules own the whole model and know nothing of our TP slices or pipeline stages,
while FSDP2 shards whatever local tensors a module holds and the pipeline schedule drives its
gradient synchronisation.

Gradients: each rank's loss is the mean over its CP shard's tokens (every TP rank of a shard
computes the same loss, vocabulary-parallel), so, as in `engines.PlainEngine`, the gradient of
the job's mean loss is the average over DP x CP of the ranks' gradients; the TP-split weights
need nothing more, and the weights TP replicates (the RMSNorm gains, which under sequence
parallelism each see only their rank's tokens) are summed over TP. Clipping uses the norm of
the whole model: squares summed over TP (replicated weights once) and over the pipeline.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch.perf.memory import GRAD_BUCKET_ELEMENTS
from ctxlaunch.runtime.trainer.data import MicroBatch
from ctxlaunch.runtime.trainer.engines import make_optimizer
from ctxlaunch.runtime.trainer.model import Transformer
from ctxlaunch.runtime.trainer.parallelize import ParallelContext
from ctxlaunch.runtime.trainer.pipeline import build_pipeline
from ctxlaunch.runtime.trainer.reshard import CheckpointState
from ctxlaunch.runtime.trainer.tensor_parallel import Sharding


def _all_reduce_buckets(grads: list[torch.Tensor], group, scale: float) -> None:  # type: ignore[no-untyped-def]
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    for grad in grads:
        bucket.append(grad)
        size += grad.numel()
        if size >= GRAD_BUCKET_ELEMENTS:
            flush()
            bucket, size = [], 0
    if bucket:
        flush()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP (DTensor) gradient, or the tensor itself."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (collective over DP x CP), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class ParallelEngine:
    """TP x PP (x DP x CP) training of this rank's slice of the model: fp32 weights, gradients
    and Adam states (sharded over DP x CP by FSDP2 for ZeRO >= 1); bf16 compute through
    autocast."""

    def __init__(self, model: Transformer, plan: dict[str, Sharding | None], spec,  # type: ignore[no-untyped-def]
                 ctx: ParallelContext, device: torch.device):
        t = spec.training
        self.ctx, self.device, self.plan = ctx, device, plan
        self.grad_accum = spec.grad_accum
        self.grad_clip = t.optimizer.grad_clip
        self.autocast_dtype = torch.bfloat16 if spec.model.dtype == "bf16" else None
        model = model.to(device)
        self.schedule = None
        self.sharded = t.zero_stage > 0 and ctx.dp_cp_group is not None
        prepare = None
        if self.sharded:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(ctx.dp_cp_group, device.type)

            def prepare(root: nn.Module) -> None:
                for block in root.blocks.values() if isinstance(root.blocks, nn.ModuleDict) \
                        else root.blocks:
                    fully_shard(block, mesh=mesh, reshard_after_forward=t.zero_stage == 3)
                # The root's weights (embedding, final norm, head) stay gathered through
                # backward: the loss uses the head after the stage's forward returns.
                fully_shard(root, mesh=mesh, reshard_after_forward=False)
        if ctx.pp > 1:
            tokens = t.seq_len // ctx.cp
            parts, self.schedule, self.first, self.last = build_pipeline(
                model, stage_layers=spec.stage_layers, pp=ctx.pp, pp_rank=ctx.pp_rank,
                group=ctx.pp_group, device=device, micro_batch=t.micro_batch, tokens=tokens,
                sp_tokens=tokens // ctx.tp, n_micro=spec.grad_accum, prepare=prepare)
            self.model = nn.ModuleList(parts)
        else:
            if prepare is not None:
                prepare(model)
            self.first = self.last = True
            self.model = model
        self.optimizer, self.scheduler = make_optimizer(self.model, t)

    # -- names ---------------------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the whole model, parameter) for every parameter this rank holds."""
        if self.ctx.pp == 1:
            return list(self.model.named_parameters())
        return [(name, p) for part in self.model for name, p in part.named_parameters()]

    # -- a step --------------------------------------------------------------------------------
    def run_micro_batches(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Forward and backward over the step's micro-batches; their losses (on the ranks
        that compute a loss: every rank without PP, the last stage with it)."""
        autocast = torch.autocast(device_type=self.device.type,
                                  dtype=self.autocast_dtype or torch.float32,
                                  enabled=self.autocast_dtype is not None)
        if self.schedule is None:
            losses = []
            for batch in batches:
                with autocast:
                    loss = self.model(batch.tokens.to(self.device),
                                      batch.positions.to(self.device),
                                      batch.targets.to(self.device))
                (loss / self.grad_accum).backward()
                losses.append(loss.detach())
            return losses
        for part in self.model:
            part.positions = batches[0].positions.to(self.device)
        args = (torch.cat([b.tokens for b in batches]).to(self.device),) if self.first else ()
        kwargs = {}
        losses: list[torch.Tensor] = []
        if self.last:
            kwargs = {"target": torch.cat([b.targets for b in batches]).to(self.device),
                      "losses": losses}
        with autocast:
            self.schedule.step(*args, **kwargs)
        return [loss.detach() for loss in losses]

    def finish_gradients(self) -> None:
        params = [p for _, p in self.named_parameters() if p.grad is not None]
        if self.ctx.dp_cp_group is not None and not self.sharded:  # FSDP reduce-scattered
            _all_reduce_buckets([p.grad for p in params], self.ctx.dp_cp_group,
                                1.0 / (self.ctx.dp * self.ctx.cp))
        if self.ctx.tp > 1:
            replicated = [_local(p.grad) for name, p in self.named_parameters()
                          if self.plan[name] is None and p.grad is not None]
            if replicated:
                _all_reduce_buckets(replicated, self.ctx.tp_group, 1.0)

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient."""
        split = replicated = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            square = _local(p.grad).detach().float().pow(2).sum()
            if self.plan[name] is None:
                replicated = replicated + square
            else:
                split = split + square
        total = split + replicated / self.ctx.tp
        groups = (self.ctx.dp_cp_group if self.sharded else None, self.ctx.tp_group,
                  self.ctx.pp_group)
        for group in groups:
            if group is not None:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def apply(self) -> float:
        norm = self.grad_norm()
        if self.grad_clip > 0:
            coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
            for _, p in self.named_parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- checks --------------------------------------------------------------------------------
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The whole model's averaged gradient, assembled on every rank (collective; for
        checks on small models)."""
        grads = {name: _full(p.grad).detach().cpu().clone()
                 for name, p in self.named_parameters()}
        mine = grads if self.ctx.dp_rank == 0 and self.ctx.cp_rank == 0 else {}
        everyone: list = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, (self.ctx.tp_rank, mine))
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        for tp_rank, grads in everyone:
            for name, grad in grads.items():
                pieces.setdefault(name, {})[tp_rank] = grad
        out = {}
        for name, by_rank in pieces.items():
            sharding = self.plan[name]
            out[name] = (by_rank[0] if sharding is None or self.ctx.tp == 1
                         else sharding.unshard([by_rank[r] for r in range(self.ctx.tp)]))
        return out

    def _checkpoint(self) -> CheckpointState:
        return CheckpointState(self.named_parameters(), self.optimizer, self.scheduler,
                               self.plan, self.ctx.tp, self.ctx.tp_group, self.device)

    def save(self, path: Path) -> None:
        self._checkpoint().save(path)

    def load(self, path: Path) -> None:
        self._checkpoint().load(path)
