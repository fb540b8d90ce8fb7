# Shapes: between stages one micro-batch's hidden states (micro_batch, S / tp, h), S the tokens
# of this CP rank; the first stage takes the token ids (micro_batch, S).
"""Pipeline stages of the decoder and their schedule (torch.distributed.pipelining).

The whole model is built on the meta device on every rank, then each PP rank keeps its stages
(and materialises only them, `parallelize`): stage i holds blocks by the spec's split
(`JobSpec.stage_layers`), the first also the embedding, the last the final norm and the head.
Parameter names are those of the whole model (`blocks.17.attn.wqkv.weight`), so gradients and
checkpoints line up across layouts.

Schedules: 1F1B, or interleaved 1F1B when the spec asks for virtual stages (rank r holds stages
r, r + pp, ...). The step's micro-batches are the spec's gradient accumulation; the loss runs on
the last stage (the chunked, vocabulary-parallel loss of `Transformer.loss`), and the schedule
scales gradients by 1 / micro-batches, as plain accumulation does.

Gradients under FSDP2 (`trainer_stage`): torch's stages run every micro-batch's backward
without FSDP2's gradient sync and reduce-scatter once after the last, so each rank accumulates
its stage's unsharded gradients in fp32 through the step (4 bytes per parameter: 12 GiB a GPU
for Llama 3 405B at TP 8 x PP 16). That stays ZeRO-1's behaviour (one reduce-scatter per step).
Under ZeRO-2 and ZeRO-3 every micro-batch's gradients are reduce-scattered as its backward
produces them, block by block, and summed into the fp32 shards, as FSDP2 does without PP, as
DeepSpeed's ZeRO-2 does, and as Llama 3's training did (gradients sharded, reduce-scattered in
fp32): m reduce-scatters a step instead of one, and only 4/(DP x CP) bytes per parameter kept.
Each micro-batch's backward is a whole one to FSDP2, so the last reduce-scatter's input is
released at its end, not kept into the next. ZeRO-3 also re-shards the weights after each
backward.

Receive buffers under 1F1B (`trainer_stage`, `perf.memory.pipeline_recv_buffers`): torch's
stages allocate one activation and one gradient buffer per micro-batch of the step and keep
them (2 GiB on a middle stage of that 405B layout at 32 micro-batches); a stage never holds
more micro-batches' inputs than its warm-up forwards, nor more than one incoming gradient, so
the trainer's stages share that many among the micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch.perf.memory import pipeline_recv_buffers
from ctxlaunch.runtime.modeling.model import Block, Documents, Transformer

if TYPE_CHECKING:
    from typing import Any

    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase


class StageModule(nn.Module):
    """Blocks [start, stop) of a model, with the embedding on the first stage and the final
    norm (and, through `Transformer.loss`, the head) on the last."""

    def __init__(self, model: Transformer, start: int, stop: int, *, first: bool, last: bool):
        super().__init__()
        self._model = [model]  # a list: not a submodule, its parameters are not ours twice
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, stop)})
        self.block_list = [block for block in self.blocks.values() if isinstance(block, Block)]
        """The blocks, typed (a plain list: the ModuleDict registers them)."""
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.positions: torch.Tensor | None = None
        """This rank's token positions (the same for every micro-batch), or set
        `set_micro_inputs` before a step."""
        self.micro_inputs: list[tuple[torch.Tensor, Documents]] | None = None
        self._next_micro = 0
        self.stage_index = 0
        """Which pipeline stage this is (0 first), set by `split_stages`."""

    def set_micro_inputs(self, inputs: list[tuple[torch.Tensor, Documents]]) -> None:
        """Each micro-batch's positions and document boundaries, in order: a schedule runs a
        stage's forwards in micro-batch order, so forward call i of the step gets entry i."""
        self.micro_inputs, self._next_micro = inputs, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self._model[0].embed_tokens(x)
        documents: Documents = None
        positions = self.positions
        if self.micro_inputs is not None:
            positions, documents = self.micro_inputs[self._next_micro % len(self.micro_inputs)]
            self._next_micro += 1
        if positions is None:
            raise RuntimeError("set the stage's positions before running it")
        # Between stages a mixture-of-experts model's router counts ride with the hidden states.
        x = self._model[0].run_blocks(
            x,
            positions,
            self.block_list,
            documents,
            receives=self.embed is None,
            sends=self.norm is None,
        )
        return self.norm(x) if self.norm is not None else x


def stage_bounds(stage_layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) of the blocks of every stage."""
    bounds, start = [], 0
    for count in stage_layers:
        bounds.append((start, start + count))
        start += count
    return bounds


def split_stages(
    model: Transformer, *, stage_layers: tuple[int, ...], pp: int, pp_rank: int
) -> list[StageModule]:
    """This PP rank's stage modules (stages pp_rank, pp_rank + pp, ...), each knowing its
    `stage_index`; the blocks, embedding, norm and head other ranks run are dropped from
    `model` (on the meta device they were never allocated)."""
    n_stages = len(stage_layers)
    modules = []
    for index, (start, stop) in enumerate(stage_bounds(stage_layers)):
        if index % pp == pp_rank:
            module = StageModule(model, start, stop, first=index == 0, last=index == n_stages - 1)
            module.stage_index = index
            modules.append(module)
    held = {int(k) for m in modules for k in m.blocks}
    for i in range(len(model.blocks)):
        if i not in held:
            model.blocks[i] = nn.Identity()
    if modules[0].stage_index != 0:
        model.embed = None
    if modules[-1].stage_index != n_stages - 1:
        model.norm, model.head = None, None
    return modules


def trainer_stage(
    *args: Any,
    recv_buffers: tuple[int, int] | None,
    shard_gradients: bool,
    reshard_after_backward: bool,
    **kwargs: Any,
) -> _PipelineStageBase:
    """A `PipelineStage` with two changes to torch's (the module docstring):
    `recv_buffers` (activations, gradients): under 1F1B the receive buffers are shared among
    micro-batches, micro-batch i using buffer i mod that count (`pipeline_recv_buffers`), not
    one per micro-batch of the step; `shard_gradients`: its FSDP2 module reduce-scatters every
    micro-batch's gradients (ZeRO-2/3), re-sharding the weights after each backward if
    `reshard_after_backward`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward

    class TrainerStage(PipelineStage):
        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            if recv_buffers is None:
                return super()._setup_forward_recv_info(num_microbatches, has_backward)
            # Micro-batch i's activations are its blocks' input, saved for its backward: the
            # 1F1B schedule receives micro-batch i + k only after i's backward (k the stage's
            # warm-up forwards), and the backward hands the input gradient over and drops it.
            super()._setup_forward_recv_info(recv_buffers[0], has_backward)
            for i in range(recv_buffers[0], num_microbatches):
                self.args_recv_info[i] = self.args_recv_info[i % recv_buffers[0]]

        def _setup_backward_recv_info(self, num_microbatches: int) -> None:
            if recv_buffers is None:
                return super()._setup_backward_recv_info(num_microbatches)
            # Micro-batch i's output gradient is received right before its backward and
            # consumed by it; the next one's is received after.
            super()._setup_backward_recv_info(recv_buffers[1])
            self.chunks = num_microbatches  # what torch's own sets besides the buffers
            for i in range(recv_buffers[1], num_microbatches):
                self.grad_recv_info[i] = self.grad_recv_info[i % recv_buffers[1]]

        def backward_maybe_with_nosync(
            self,
            backward_type: str,
            bwd_kwargs: dict,
            last_backward: bool = False,
        ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
            if (
                not shard_gradients
                or not isinstance(self.submod, FSDPModule)
                or backward_type != "full"
            ):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            # Every micro-batch's backward is a whole one in FSDP2's sense, as plain
            # accumulation without PP: its gradients are reduce-scattered and, at its end,
            # the last reduce-scatter's input is released (is_last_backward); the schedule's
            # perform_reduce_grad after the last micro-batch then finds nothing left to do.
            self.submod.set_is_last_backward(True)
            self.submod.set_reshard_after_backward(reshard_after_backward)
            self.submod.set_requires_gradient_sync(True)
            grads = stage_backward(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
            )
            return tuple(grads), None

    return TrainerStage(*args, **kwargs)


def pipeline_schedule(
    model: Transformer,
    modules: list[StageModule],
    *,
    n_stages: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    micro_batch: int,
    tokens: int,
    sp_tokens: int,
    n_micro: int,
    hidden_dtype: torch.dtype = torch.float32,
    shard_gradients: bool = False,
    reshard_after_backward: bool = False,
) -> PipelineScheduleMulti | PipelineScheduleSingle:
    """The schedule that runs this rank's (materialised) stage modules over `n_micro`
    micro-batches. `tokens`: one CP rank's tokens per sequence; `sp_tokens`: the share of them
    a TP rank holds between blocks; `hidden_dtype`: the dtype of the hidden states sent
    between stages; `shard_gradients`: FSDP2 reduce-scatters every micro-batch's gradients
    (ZeRO-2/3), re-sharding the weights after each backward if `reshard_after_backward`."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    stages: list[_PipelineStageBase] = []
    # A mixture-of-experts model's router counts ride in rows after the hidden states (moe.py).
    carried = model.routing.rows if model.routing is not None else 0
    for module in modules:
        # Explicit shapes: shape inference would run the stage on meta tensors, and the TP and
        # CP collectives inside cannot.
        if module.stage_index == 0:
            example_in = torch.zeros(micro_batch, tokens, dtype=torch.long, device=device)
        else:
            example_in = torch.zeros(
                micro_batch,
                sp_tokens + carried,
                model.hidden,
                device=device,
                dtype=hidden_dtype,
                requires_grad=True,
            )
        example_out = torch.zeros(
            micro_batch,
            sp_tokens + (carried if module.stage_index < n_stages - 1 else 0),
            model.hidden,
            device=device,
            dtype=hidden_dtype,
            requires_grad=True,
        )
        recv_buffers = (
            pipeline_recv_buffers(n_stages, module.stage_index, n_micro)
            if len(modules) == 1
            else None
        )
        stages.append(
            trainer_stage(
                module,
                module.stage_index,
                n_stages,
                device,
                input_args=(example_in,),
                output_args=(example_out,),
                group=group,
                recv_buffers=recv_buffers,
                shard_gradients=shard_gradients,
                reshard_after_backward=reshard_after_backward,
            )
        )

    def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model.loss(output, targets)

    if len(stages) == 1:
        return Schedule1F1B(stages[0], n_micro, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn)
