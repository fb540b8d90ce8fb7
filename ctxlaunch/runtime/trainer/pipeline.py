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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch.runtime.trainer.model import Block, Documents, Transformer

if TYPE_CHECKING:
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
            x = self.embed(x)
        documents: Documents = None
        positions = self.positions
        if self.micro_inputs is not None:
            positions, documents = self.micro_inputs[self._next_micro % len(self.micro_inputs)]
            self._next_micro += 1
        if positions is None:
            raise RuntimeError("set the stage's positions before running it")
        x = self._model[0].run_blocks(x, positions, self.block_list, documents)
        return self.norm(x) if self.norm is not None else x


def stage_bounds(stage_layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) of the blocks of every stage."""
    bounds, start = [], 0
    for count in stage_layers:
        bounds.append((start, start + count))
        start += count
    return bounds


def split_stages(model: Transformer, *, stage_layers: tuple[int, ...], pp: int,
                 pp_rank: int) -> list[StageModule]:
    """This PP rank's stage modules (stages pp_rank, pp_rank + pp, ...), each knowing its
    `stage_index`; the blocks, embedding, norm and head other ranks run are dropped from
    `model` (on the meta device they were never allocated)."""
    n_stages = len(stage_layers)
    modules = []
    for index, (start, stop) in enumerate(stage_bounds(stage_layers)):
        if index % pp == pp_rank:
            module = StageModule(model, start, stop, first=index == 0,
                                 last=index == n_stages - 1)
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


def pipeline_schedule(model: Transformer, modules: list[StageModule], *, n_stages: int,
                      group: dist.ProcessGroup | None, device: torch.device, micro_batch: int,
                      tokens: int, sp_tokens: int, n_micro: int,
                      hidden_dtype: torch.dtype = torch.float32) -> PipelineScheduleMulti | \
        PipelineScheduleSingle:
    """The schedule that runs this rank's (materialised) stage modules over `n_micro`
    micro-batches. `tokens`: one CP rank's tokens per sequence; `sp_tokens`: the share of them
    a TP rank holds between blocks; `hidden_dtype`: the dtype of the hidden states sent
    between stages."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    stages: list[_PipelineStageBase] = []
    for module in modules:
        # Explicit shapes: shape inference would run the stage on meta tensors, and the TP and
        # CP collectives inside cannot.
        if module.stage_index == 0:
            example_in = torch.zeros(micro_batch, tokens, dtype=torch.long, device=device)
        else:
            example_in = torch.zeros(micro_batch, sp_tokens, model.hidden, device=device,
                                     dtype=hidden_dtype, requires_grad=True)
        example_out = torch.zeros(micro_batch, sp_tokens, model.hidden, device=device,
                                  dtype=hidden_dtype, requires_grad=True)
        stages.append(PipelineStage(module, module.stage_index, n_stages, device,
                                    input_args=(example_in,), output_args=(example_out,),
                                    group=group))

    def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model.loss(output, targets)

    if len(stages) == 1:
        return Schedule1F1B(stages[0], n_micro, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn)
