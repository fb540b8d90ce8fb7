"""How gradients become updates. One `Engine` protocol; two engines behind it:

- `TorchEngine`, plain torch on whatever `parallelize` built: ZeRO-0 (every rank keeps fp32
  weights, gradients and Adam states of its slice) or FSDP2 (training.engine fsdp2: those
  states sharded over DP x CP), at any TP x CP x DP x PP layout;
- `DeepSpeedEngine`, DeepSpeed ZeRO-1..3 (training.engine deepspeed), at TP 1 x PP 1 (ZeRO-1
  and ZeRO-2 under expert parallelism, the experts DeepSpeed's MoE parameters).

Both average gradients over the ranks holding the same weights (DP x CP) and over the
micro-batches (1 / grad_accum). Each rank's loss is its summed loss over its predicted tokens
divided by P / (DP x CP x grad_accum), where P is the step's predicted-token count over all of
them (`run_micro_batches` gets it; every TP rank of a CP shard computes the same loss,
vocabulary-parallel), and the ring and Ulysses backward passes carry each rank's contribution
to the others' K/V, so the averaged gradient is that of (sum of all losses) / P: the token
mean over the step, however the tokens (and the ignored ones of a document mask) fall on the
ranks. Without ignored tokens P / (DP x CP x grad_accum) is each rank's token count, the plain
per-rank mean. The TP-split weights need nothing more; the weights TP replicates
(the RMSNorm gains, which under sequence parallelism each see only their rank's tokens) are
summed over TP. Clipping uses the norm of the whole model: squares summed over TP (replicated
weights once) and over the pipeline.

Under expert parallelism each expert weight gathers the gradients of the tokens of its EP group
(the all-to-all's backward), scaled by 1 / ep (moe.Experts), and is averaged over the ranks
holding the same experts (dp x cp / ep of them): the average over DP x CP, as for every other
weight. DeepSpeed sums an expert gradient over those ranks and divides it by DP x CP, as it
divides every gradient, so under it the experts keep their gradients unscaled: the same
average. The load-balancing loss's gradient is injected at each part's output (moe.py), scaled
by `loss_scale`'s replicas / micro-batches so that the same averaging gives one process's.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch.cp import comm as cp_comm
from ctxlaunch.perf.memory import (
    GRAD_BUCKET_ELEMENTS,
    ZERO3_PREFETCH_ELEMENTS,
    ZERO_BUCKET_ELEMENTS,
)
from ctxlaunch.runtime.checkpointing.reshard import CheckpointState
from ctxlaunch.runtime.data.batches import MicroBatch
from ctxlaunch.runtime.modeling.moe import Experts
from ctxlaunch.runtime.parallel.context import ParallelContext
from ctxlaunch.runtime.parallel.parallelize import ModelParts
from ctxlaunch.runtime.parallel.pipeline import StageModule
from ctxlaunch.runtime.trainer import fastpath

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec, TrainingSpec


class Engine(Protocol):
    """One rank's side of a training step, whatever keeps the model states."""

    def run_micro_batches(
        self, batches: list[MicroBatch], predicted_tokens: int
    ) -> list[torch.Tensor]:
        """Forward and backward over the step's micro-batches, gradients accumulated; their
        losses (detached) on the ranks that compute a loss (every rank without PP, the last
        stage with it). `predicted_tokens`: the step's count of predicted targets over every
        DP x CP rank and micro-batch (see the module docstring)."""

    def finish_gradients(self) -> None:
        """Average the accumulated gradients over the job (a no-op where the backward did)."""

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged, unsharded gradient of every parameter (collective; for checks)."""

    def apply(self) -> float | torch.Tensor:
        """Clip, step the optimizer and the schedule; returns the gradient norm (a 0-d tensor
        on the device where reading it would wait for the device: the loop reads it with the
        loss, in the step's one host synchronisation)."""

    def lr(self) -> float:
        """The learning rate of the next update."""

    def host_tensors(self) -> list[torch.Tensor]:
        """What this rank keeps in host memory by training.offload (the offloaded optimizer
        states, master weights and gradients, parameters, and the activation buffers), for
        the memory checks and telemetry; empty without offload."""

    def save(self, path: Path) -> None:
        """Write this rank's part of a checkpoint of model and optimizer states."""

    def load(self, path: Path) -> None:
        """Read back what `save` wrote (at any layout, for `TorchEngine`)."""


def lr_lambda(steps: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine decay to min_ratio at the last step."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        span = max(steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, never on norm gains."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(
    model: nn.Module,
    training: TrainingSpec,
    fused: bool = False,
    cpu_adam: bool = False,
    regroup: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its warm-up/cosine schedule, from the spec's training section: one fused
    kernel per step with `fused` (training.fused_optimizer), else `foreach`; with `cpu_adam`,
    DeepSpeed's CPU Adam in AdamW mode (what ZeRO-Offload steps in host memory; its op is
    compiled on first use). `regroup` rewrites the parameter groups first (DeepSpeed's
    expert groups)."""
    opt = training.optimizer
    groups = param_groups(model, opt.weight_decay)
    if regroup is not None:
        groups = regroup(groups)
    optimizer: torch.optim.Optimizer
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(
            groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, adamw_mode=True
        )
    else:
        # Neither a fused nor a foreach step takes FSDP2's sharded parameters and plain ones
        # together (the experts a rank alone holds beside sharded dense weights): those step
        # one tensor at a time (perf.layout's foreach_optimizer plans that).
        mixed = len({hasattr(p, "full_tensor") for p in model.parameters()}) > 1
        kernel: dict[str, bool] = (
            {"foreach": False} if mixed else {"fused": True} if fused else {"foreach": True}
        )
        optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, **kernel)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(training.steps, opt.warmup_steps, opt.min_lr_ratio)
    )
    return optimizer, scheduler


def _all_reduce_buckets(
    grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int
) -> None:
    """Sum `grads` over `group` in flat buckets of GRAD_BUCKET_ELEMENTS, divided by
    `divisor` (the planner counts one bucket's buffer)."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        if divisor != 1:
            flat /= divisor
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    for grad in grads:
        bucket.append(grad)
        size += grad.numel()
        if size >= GRAD_BUCKET_ELEMENTS:
            flush()
            bucket, size = [], 0
    if bucket:
        flush()


def loss_divisor(predicted_tokens: int, replicas: int, grad_accum: int) -> float:
    """What each rank divides its summed loss by so that gradients averaged over `replicas`
    (DP x CP) ranks and `grad_accum` micro-batches are those of the step's token mean."""
    return max(predicted_tokens, 1) / (replicas * grad_accum)


def set_router_scale(model: nn.Module, replicas: int, grad_accum: int) -> None:
    """The scale of the load-balancing loss's injected gradient this step (moe.Routing): the
    gradients are averaged over `replicas` ranks and `grad_accum` micro-batches, as the
    language-model loss's are through `loss_divisor`."""
    routing = getattr(model, "routing", None)
    if routing is not None:
        routing.scale = replicas / grad_accum


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP (DTensor) gradient, or the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (collective over DP x CP), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class TorchEngine:
    """Plain torch on this rank's model parts: fp32 weights, gradients and Adam states (sharded
    over DP x CP by FSDP2 when `parallelize` wrapped the parts); bf16 compute through
    autocast; the pipeline schedule, or a forward and backward per micro-batch."""

    def __init__(
        self, parts: ModelParts, spec: JobSpec, ctx: ParallelContext, device: torch.device
    ):
        t = spec.training
        self.parts, self.ctx, self.device, self.plan = parts, ctx, device, parts.plan
        self.grad_accum = spec.grad_accum
        self.grad_clip = t.optimizer.grad_clip
        self.autocast_dtype = torch.bfloat16 if spec.model.dtype == "bf16" else None
        self.module = parts.parts[0] if len(parts.parts) == 1 else nn.ModuleList(parts.parts)
        self.fused_optimizer = fastpath.resolve(t.fused_optimizer, device)
        self.optimizer, self.scheduler = make_optimizer(self.module, t, self.fused_optimizer)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the whole model, parameter) for every parameter this rank holds."""
        return self.parts.named_parameters()

    # -- a step --------------------------------------------------------------------------------
    def run_micro_batches(
        self, batches: list[MicroBatch], predicted_tokens: int
    ) -> list[torch.Tensor]:
        self.parts.model.loss_divisor = loss_divisor(
            predicted_tokens, self.ctx.dims.dp * self.ctx.dims.cp, self.grad_accum
        )
        # A pipeline schedule divides every gradient by the micro-batches after the step.
        set_router_scale(
            self.parts.model,
            self.ctx.dims.dp * self.ctx.dims.cp,
            1 if self.parts.schedule is not None else self.grad_accum,
        )
        autocast = torch.autocast(
            device_type=self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )
        schedule = self.parts.schedule
        if schedule is None:
            losses = []
            for batch in batches:
                with autocast:
                    loss = self.module(
                        batch.tokens.to(self.device),
                        batch.positions.to(self.device),
                        batch.targets.to(self.device),
                        batch.documents,
                    )
                (loss / self.grad_accum).backward()
                losses.append(loss.detach())
            return losses
        for part in self.parts.parts:
            assert isinstance(part, StageModule)  # a schedule runs stages
            part.set_micro_inputs([(b.positions.to(self.device), b.documents) for b in batches])
        args = (torch.cat([b.tokens for b in batches]).to(self.device),) if self.parts.first else ()
        kwargs: dict[str, Any] = {}
        stage_losses: list[torch.Tensor] = []
        if self.parts.last:
            kwargs = {
                "target": torch.cat([b.targets for b in batches]).to(self.device),
                "losses": stage_losses,
            }
        with autocast:
            schedule.step(*args, **kwargs)
        return [loss.detach() for loss in stage_losses]

    def finish_gradients(self) -> None:
        experts = self.parts.experts
        dense = [
            p.grad for n, p in self.named_parameters() if p.grad is not None and n not in experts
        ]
        held = [p.grad for n, p in self.named_parameters() if p.grad is not None and n in experts]
        if not self.parts.sharded:  # FSDP reduce-scattered
            if self.ctx.dp_cp_group is not None:
                _all_reduce_buckets(dense, self.ctx.dp_cp_group, self.ctx.dims.shard_group)
            if self.ctx.edp_group is not None:
                _all_reduce_buckets(held, self.ctx.edp_group, self.ctx.dims.expert_shard_group)
        if self.ctx.dims.tp > 1:
            replicated = [
                _local(p.grad)
                for name, p in self.named_parameters()
                if self.plan[name] is None and p.grad is not None
            ]
            if replicated:
                _all_reduce_buckets(replicated, self.ctx.tp_group, 1)

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient."""
        split = replicated = experts = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            # FSDP2's CPU offload keeps the gradient shards in host memory.
            square = _local(p.grad).detach().float().pow(2).sum().to(self.device)
            if name in self.parts.experts:
                experts = experts + square
            elif self.plan[name] is None:
                replicated = replicated + square
            else:
                split = split + square
        total = split + replicated / self.ctx.dims.tp
        if self.parts.sharded and self.ctx.dp_cp_group is not None:
            dist.all_reduce(total, group=self.ctx.dp_cp_group)
        # Experts: replicated over TP, split over the EP group (and sharded over the ranks
        # holding the same ones).
        experts = experts / self.ctx.dims.tp
        held_apart = (
            self.ctx.edp_group if self.parts.sharded and self.ctx.dims.ep > 1 else None,
            self.ctx.ep_group,
        )
        for group in held_apart:
            if group is not None:
                dist.all_reduce(experts, group=group)
        if self.parts.sharded and self.ctx.dims.ep == 1 and self.ctx.dp_cp_group is not None:
            dist.all_reduce(experts, group=self.ctx.dp_cp_group)
        total = total + experts
        for group in (self.ctx.tp_group, self.ctx.pp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def apply(self) -> torch.Tensor:
        norm = self.grad_norm()
        if self.grad_clip > 0:
            coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
            for _, p in self.named_parameters():
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.device))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def host_tensors(self) -> list[torch.Tensor]:
        out = self.parts.activation_offload.host_tensors() if self.parts.activation_offload else []
        if self.parts.states_on_host:
            for _, p in self.named_parameters():
                out.append(_local(p))
                if p.grad is not None:
                    out.append(_local(p.grad))
            out += [
                _local(value)
                for state in self.optimizer.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor) and value.dim() > 0
            ]
        return out

    # -- checks --------------------------------------------------------------------------------
    def full_gradients(self) -> dict[str, torch.Tensor]:
        grads = {
            name: _full(p.grad).detach().cpu().clone()
            for name, p in self.named_parameters()
            if p.grad is not None
        }
        if self.ctx.world_size == 1:
            return grads
        # The dense weights of the first DP x CP rank; each expert slice from the first EP group.
        first_replica = self.ctx.dp_rank == 0 and self.ctx.cp_rank == 0
        first_experts = self.ctx.dp_rank * self.ctx.dims.cp + self.ctx.cp_rank < self.ctx.dims.ep
        mine = {
            name: grad
            for name, grad in grads.items()
            if (first_experts if name in self.parts.experts else first_replica)
        }
        everyone: list[tuple[int, int, dict[str, torch.Tensor]] | None] = [
            None
        ] * self.ctx.world_size
        dist.all_gather_object(everyone, (self.ctx.tp_rank, self.ctx.ep_rank, mine))
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        expert_pieces: dict[str, dict[int, torch.Tensor]] = {}
        for entry in everyone:
            assert entry is not None  # all_gather_object filled every slot
            tp_rank, ep_rank, theirs = entry
            for name, grad in theirs.items():
                if name in self.parts.experts:
                    expert_pieces.setdefault(name, {})[ep_rank] = grad
                else:
                    pieces.setdefault(name, {})[tp_rank] = grad
        out = {
            name: torch.cat([by_rank[r] for r in sorted(by_rank)])
            for name, by_rank in expert_pieces.items()
        }
        for name, by_rank in pieces.items():
            sharding = self.plan[name]
            out[name] = (
                by_rank[0]
                if sharding is None or self.ctx.dims.tp == 1
                else sharding.unshard([by_rank[r] for r in range(self.ctx.dims.tp)])
            )
        return out

    # -- checkpoints: the layout-independent format (reshard.py) -------------------------------
    def _checkpoint(self) -> CheckpointState:
        return CheckpointState(
            self.named_parameters(),
            self.optimizer,
            self.scheduler,
            self.plan,
            self.ctx.dims.tp,
            self.ctx.tp_group,
            self.device,
            frozenset(self.parts.experts),
            self.ctx.ep_group,
        )

    def save(self, path: Path) -> None:
        self._checkpoint().save(path)

    def load(self, path: Path) -> None:
        self._checkpoint().load(path)


def deepspeed_config(spec: JobSpec, cuda: bool = True) -> dict[str, Any]:
    """DeepSpeed's configuration for the spec (its buckets the planner's constants); with
    training.offload, ZeRO-Offload's sections (host buffers pinned on `cuda` only: DeepSpeed's
    CPU accelerator has nothing to pin for)."""
    t = spec.training
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.offload.optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if t.offload.parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if t.zero_stage in (1, 2):
        zero.update(
            reduce_bucket_size=ZERO_BUCKET_ELEMENTS,
            allgather_bucket_size=ZERO_BUCKET_ELEMENTS,
            overlap_comm=False,
        )
    if t.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=ZERO3_PREFETCH_ELEMENTS,
            reduce_bucket_size=ZERO_BUCKET_ELEMENTS,
        )
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
    vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    # Without an mpu, ZeRO reduces over its own copy of the world group, which it makes with no
    # timeout (torch's 30-minute default): make that copy here, under the job's.
    if groups._WORLD_GROUP is None:
        groups._WORLD_GROUP = cp_comm.new_group(list(range(dist.get_world_size())))


def expert_group_name(ep: int) -> str:
    """The name DeepSpeed keys its expert groups by (`deepspeed.utils.groups`; its checkpoint
    code reads the EP degree back from it)."""
    return f"ep_size_{ep}"


def register_expert_groups(ctx: ParallelContext) -> str:
    """Hand DeepSpeed this rank's EP and expert-data-parallel groups, the ones `build_context`
    made, under `expert_group_name`; returns that name.

    DeepSpeed's own creation (`groups._create_expert_and_data_parallel` without model
    parallelism) would make the same ranks at TP 1 x PP 1 (DeepSpeed's only layout here): EP
    groups of ep consecutive ranks, expert-data-parallel groups of every ep-th rank, which is
    ctxlaunch's order (the shard group is rank order when tp = pp = 1). Registering ours
    instead keeps one communicator per group, under the job's timeout. Where each rank alone
    holds its experts (ep = dp x cp) `build_context` makes no expert-data-parallel group, and
    DeepSpeed still needs one to partition and reduce over: each rank gets a group of itself
    (group creation is collective, so every rank creates every one)."""
    from deepspeed.utils import groups

    d = ctx.dims
    assert d.tp == 1 and d.pp == 1 and ctx.ep_group is not None  # the spec's rules
    name = expert_group_name(d.ep)
    ep_ranks = next(r for role, r in d.group_ranks() if role == "ep" and ctx.rank in r)
    edp_group = ctx.edp_group
    if edp_group is None:
        alone = [cp_comm.new_group([rank]) for rank in range(d.world_size)]
        edp_ranks, edp_group = [ctx.rank], alone[ctx.rank]
    else:
        edp_ranks = next(r for role, r in d.group_ranks() if role == "edp" and ctx.rank in r)
    groups._EXPERT_PARALLEL_GROUP[name] = ctx.ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ep_ranks
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = edp_ranks
    return name


def mark_experts(parts: ModelParts, group_name: str) -> None:
    """Tell DeepSpeed which parameters are experts, its way (`deepspeed.moe.utils.
    is_moe_param`: `allreduce` False and the `group_name` of their expert groups), and leave
    their gradients unscaled: DeepSpeed divides the expert gradients it sums over the ranks
    holding the same experts by DP x CP (see the module docstring)."""
    for name, param in parts.model.named_parameters():
        if name in parts.experts:
            # Attributes DeepSpeed reads off the tensor, which a Parameter does not declare.
            param.allreduce = False  # type: ignore[attr-defined]  # see above
            param.group_name = group_name  # type: ignore[attr-defined]  # see above
    for module in parts.model.modules():
        if isinstance(module, Experts):
            module.gradient_scale = 1.0


def _expert_parallel_engine_class() -> type:
    """DeepSpeed's engine, told that the model has experts. DeepSpeed recognises a
    mixture-of-experts model only by an instance of its own MoE module (or of its AutoEP
    layer, which brings its own router and dispatch); ctxlaunch's experts are its own module,
    so without this the ZeRO optimizer would partition and reduce the expert groups over
    DP x CP, as dense weights."""
    from deepspeed.runtime.engine import DeepSpeedEngine as Base

    class ExpertParallelEngine(Base):
        def _configure_distributed_model(self, model: nn.Module) -> None:
            super()._configure_distributed_model(model)
            self.has_moe_layers = True

    return ExpertParallelEngine


# What ZeRO-Offload allocates in host memory, by the attribute of DeepSpeed's ZeRO optimizer
# that holds it (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py): the fp32 partitions
# (with their fp32 gradients), the 16-bit copies the updated partitions go back to the device
# through, the gradients accumulated over micro-batches, and a largest-parameter staging buffer.
_DEEPSPEED_HOST_ATTRIBUTES = (
    "single_partition_of_fp32_groups",
    "param_buffer_of_bit16_for_cpu_offload_groups",
    "accumulated_grads_in_cpu",
    "temp_grad_buffer_for_cpu_offload",
    "fp32_partitioned_groups_flat",
    "grad_partitions_flat_buffer",
)


def deepspeed_host_tensors(zero_optimizer: Any) -> list[torch.Tensor]:
    """The tensors DeepSpeed's ZeRO-Offload keeps in host memory: the buffers named above, the
    CPU Adam's states, and under parameter offload every partitioned (not persistent)
    parameter's 16-bit partition."""
    out: list[torch.Tensor] = []

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append(value)
            if value.grad is not None:
                out.append(value.grad)
        elif isinstance(value, list | tuple):
            for item in value:
                add(item)
        elif isinstance(value, dict):
            for item in value.values():
                add(item)

    for name in _DEEPSPEED_HOST_ATTRIBUTES:
        add(getattr(zero_optimizer, name, None))
    inner = getattr(zero_optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        add([v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0])
    if getattr(zero_optimizer, "offload_param", False):
        for group in getattr(zero_optimizer, "fp16_groups", []):
            for param in group:
                if not getattr(param, "ds_persist", False) and hasattr(param, "ds_tensor"):
                    out.append(param.ds_tensor)
    return out


class DeepSpeedEngine:
    """ZeRO-1..3 through `deepspeed.initialize` with a torch AdamW, on the whole model (TP 1 x
    PP 1: DeepSpeed knows nothing of TP slices or pipeline stages); under expert parallelism
    (ZeRO-1 and ZeRO-2) with the experts as DeepSpeed's MoE parameters, on ctxlaunch's EP and
    expert-data-parallel groups."""

    def __init__(
        self, parts: ModelParts, spec: JobSpec, ctx: ParallelContext, device: torch.device
    ):
        import deepspeed

        t = spec.training
        self.ctx, self.device = ctx, device
        self.grad_accum = spec.grad_accum
        self.replicas = ctx.dims.shard_group  # DeepSpeed's data-parallel world (TP 1 x PP 1)
        model = parts.model
        self.activation_offload = parts.activation_offload
        self.offload_states = t.offload.optimizer
        # Under expert parallelism the experts are DeepSpeed's MoE parameters: their own
        # optimizer groups, partitioned and reduced over the ranks holding the same experts.
        self.experts = frozenset(parts.experts) if ctx.dims.ep > 1 else frozenset()
        regroup = None
        if self.experts:
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            mark_experts(parts, register_expert_groups(ctx))

            def regroup(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
                named = [{**g, "name": f"group_{i}"} for i, g in enumerate(groups)]
                return split_params_into_different_moe_groups_for_optimizer(named)

        optimizer, scheduler = make_optimizer(
            model, t, cpu_adam=t.offload.optimizer, regroup=regroup
        )
        # deepspeed.initialize builds its `DeepSpeedEngine` by that module-level name: under
        # expert parallelism, the subclass that knows the model has experts, for the call.
        module_vars = vars(deepspeed)
        engine_class = module_vars["DeepSpeedEngine"]
        if self.experts:
            module_vars["DeepSpeedEngine"] = _expert_parallel_engine_class()
        try:
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=deepspeed_config(spec, cuda=device.type == "cuda"),
                dist_init_required=False,
            )
        finally:
            module_vars["DeepSpeedEngine"] = engine_class
        self.model = self.engine.module

    def run_micro_batches(
        self, batches: list[MicroBatch], predicted_tokens: int
    ) -> list[torch.Tensor]:
        self.model.loss_divisor = loss_divisor(predicted_tokens, self.replicas, self.grad_accum)
        set_router_scale(self.model, self.replicas, self.grad_accum)
        losses = []
        for micro, batch in enumerate(batches):
            loss = self.engine(
                batch.tokens.to(self.device),
                batch.positions.to(self.device),
                batch.targets.to(self.device),
                batch.documents,
            )
            self.engine.backward(loss)  # scales by 1/grad_accum itself
            if micro < self.grad_accum - 1:
                self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step count
            losses.append(loss.detach().float())
        return losses

    def finish_gradients(self) -> None:
        pass  # reduced (and partitioned) inside the boundary micro-batch's backward

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        grads = {
            name: safe_get_full_grad(p).detach().float().clone()
            for name, p in self.model.named_parameters()
        }
        for name in sorted(self.experts):  # this rank's experts: the EP group's, in rank order
            pieces = [torch.empty_like(grads[name]) for _ in range(self.ctx.dims.ep)]
            dist.all_gather(pieces, grads[name], group=self.ctx.ep_group)
            grads[name] = torch.cat(pieces)
        return grads

    def apply(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def host_tensors(self) -> list[torch.Tensor]:
        out = self.activation_offload.host_tensors() if self.activation_offload else []
        if self.offload_states:
            out += deepspeed_host_tensors(self.optimizer)
        return out

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(
            str(path.parent),
            tag=path.name,
            save_latest=False,
            client_state={SAVED_EP_KEY: self.ctx.dims.ep},
        )

    def load(self, path: Path) -> None:
        from ctxlaunch.runtime.checkpointing.safe_unpickle import deepspeed_reads_weights_only

        check_deepspeed_ep(path, self.ctx.dims.ep)
        with deepspeed_reads_weights_only(path):  # its files' pickles never run code
            load_path, _ = self.engine.load_checkpoint(
                str(path.parent),
                tag=path.name,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {path}")
        if self.experts:
            # The module file is the first rank's, its experts included (DeepSpeed writes
            # experts to files of their own only for its MoE module); each rank's fp32
            # partitions hold its own experts: the weights are taken from those.
            self.optimizer.update_lp_params()


SAVED_EP_KEY = "ctxlaunch_ep"
"""The EP degree a DeepSpeed checkpoint was saved at, in its model-states file (absent: 1)."""


def check_deepspeed_ep(path: Path, ep: int) -> None:
    """Refuse, in one sentence, a DeepSpeed checkpoint saved at another EP degree: each rank's
    partition files hold the experts it held, and DeepSpeed's format resumes only at the
    layout it was saved at."""
    from ctxlaunch.runtime.checkpointing.safe_unpickle import (
        CheckpointOfAnotherModel,
        weights_only_load,
    )

    for states in path.glob("*model_states.pt"):
        saved = weights_only_load(states, map_location="cpu", mmap=True).get(SAVED_EP_KEY, 1)
        if saved != ep:
            raise CheckpointOfAnotherModel(
                f"{path} was saved by DeepSpeed at ep = {saved}, and a DeepSpeed checkpoint "
                f"resumes only at the layout it was saved at, but this run has ep = {ep}; "
                f"fix: parallel.ep: {saved}, or another training.checkpoint.dir"
            )


def make_engine(
    parts: ModelParts, spec: JobSpec, ctx: ParallelContext, device: torch.device
) -> Engine:
    """The engine `JobSpec.state_engine` names, on the parts `parallelize` built."""
    if spec.state_engine == "deepspeed":
        if dist.is_initialized():
            init_deepspeed(dist.get_backend())
        return DeepSpeedEngine(parts, spec, ctx, device)
    return TorchEngine(parts, spec, ctx, device)
