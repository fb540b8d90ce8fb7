# Shapes: hidden (B, S, h) with S this CP rank's tokens; under sequence parallelism each TP rank
# holds (B, S / tp, h) of them between the blocks' column- and row-parallel halves.
"""Megatron-style tensor parallelism with sequence parallelism, on plain process groups.

Why hand-written rather than DTensor's `parallelize_module`: attention is ours (ring, Ulysses,
hybrid CP on local tensors; DTensor has no CPU SDPA strategy), the norms and SwiGLU are custom
autograd functions the planner's memory constants are derived from, and the two collectives
sequence parallelism needs are four lines each. Every collective here is one of two conjugate
pairs, so forward and backward move the same bytes:

    gather_sequence:  forward all-gather over the sequence,  backward reduce-scatter
    scatter_sequence: forward reduce-scatter over the sequence, backward all-gather

A block: x (B, S/t, h) -> RMSNorm (local tokens) -> gather_sequence -> column-parallel q/k/v
(this rank's heads) -> attention over the CP group on those heads -> row-parallel o projection
(partial sums) -> scatter_sequence -> residual; the same around the SwiGLU. The gather and the
column-parallel projection after it are one Function (`gather_linear`): it keeps the norm
output's local shard and gathers it again in backward, not the gathered tensor.

The embedding and the output head are split by vocabulary: the embedding sums each rank's
rows with a reduce-scatter straight into the sequence-parallel layout, and the cross-entropy
runs on vocabulary-sharded logits (max, sum of exponentials and the target logit all-reduced
over TP), one token chunk at a time, so no rank ever holds a whole row of logits (the chunked
loss is loss.py's, given this rank's `VocabShard`; the forward-only scores are here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    pass


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    front = x.transpose(0, 1).contiguous()  # (S/t, B, ...): gather along dim 0
    out = front.new_empty((front.shape[0] * world, *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    front = x.transpose(0, 1).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    return out.transpose(0, 1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_seq(grad, ctx.group), None


class _GatherLinear(torch.autograd.Function):
    """all_gather_seq(x) @ weight.T (+ bias) in `dtype`, keeping for backward only x's local
    shard (in `dtype`) and gathering it again there for the weight's gradient, as Megatron's
    sequence parallelism does: a*h per sequence-parallel token saved instead of a*h per token
    of the whole CP shard. The input gradient is reduce-scattered in x's dtype, as the separate
    gather and linear did under autocast; the bias (column-parallel, this rank's columns) gets
    the output gradient summed over tokens."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            local = x.to(dtype)  # cast, then gather: the same values, and half the bytes moved
            w = weight.to(dtype)  # autocast's copy of the weight, saved as it saved it
            b = None if bias is None else bias.to(dtype)
            out = F.linear(_all_gather_seq(local, group), w, b)
        ctx.group, ctx.x_dtype, ctx.weight_dtype = group, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(local, w)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local, w = ctx.saved_tensors
        full = _all_gather_seq(local, ctx.group)
        grad = grad.to(w.dtype)
        flat = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat.t() @ full.reshape(-1, full.shape[-1])
        del full
        grad_bias = None if ctx.bias_dtype is None else flat.sum(0).to(ctx.bias_dtype)
        grad_x = _reduce_scatter_seq((grad @ w).to(ctx.x_dtype), ctx.group)
        return grad_x, grad_weight.to(ctx.weight_dtype), grad_bias, None, None


def gather_linear(x: torch.Tensor, linear: nn.Linear, group: dist.ProcessGroup) -> torch.Tensor:
    """linear(gather_sequence(x)) for a column-parallel projection (its bias, if any, this
    rank's columns), saving only x's local shard for backward (`_GatherLinear`); in the
    autocast dtype when autocast is on."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return _GatherLinear.apply(x, linear.weight, linear.bias, group, dtype)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, S/t, ...) -> (B, S, ...); backward reduce-scatters (sums) the gradient."""
    return _GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Partial sums (B, S, ...) -> this rank's summed tokens (B, S/t, ...)."""
    return _ScatterSequence.apply(x, group)


class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start .. vocab_start + V/t of the embedding; the output is this rank's
    sequence-parallel share of the summed lookups."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start, self.group = vocab_start, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_sequence(rows, self.group)


@torch.no_grad()
def vocab_parallel_token_scores(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and whether the target is the arg-max, of fp32 logits sharded by
    vocabulary (T, V/t); forward only. Targets -100 score loss 0 and False."""
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    target_logit = logits.gather(-1, index).squeeze(-1)
    hit = (mine & (target_logit >= peak)).float()
    packed = torch.stack(
        [(logits - peak.unsqueeze(-1)).exp().sum(-1), (target_logit - peak) * mine, hit]
    )
    dist.all_reduce(packed, group=group)
    sum_exp, shifted_target, hit = packed
    valid = targets != -100
    return (sum_exp.log() - shifted_target) * valid, (hit > 0) & valid
