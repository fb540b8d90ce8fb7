# Shapes: hidden (T, h), this rank's tokens flattened over the batch (TP-gathered under TP);
# weight (V, h), V the vocabulary this rank holds (V / tp under TP); targets (T,), -100 ignored.
"""The chunked next-token loss, torchtitan style: forward and backward per chunk of tokens.

Each chunk of `chunk_tokens` tokens computes its logits (T, V) in the compute dtype, the summed
cross-entropy, and at once the gradient of that sum: d(logits) is formed in place in the
chunk's fp32 working tensor (the logits themselves in fp32; their one upcast in 16-bit, cast
back into the logits' own buffer), then multiplied into a gradient of the whole input (T, h)
allocated once before the first chunk, and into the head weight's gradient (V, h), accumulated
chunk by chunk. Backward only scales those two by the incoming gradient: nothing is recomputed,
no logits outlive their chunk, and the full (tokens x vocab) logits never exist, in fp32 or
otherwise. The loss keeps for backward the gradient of its input (the same bytes as the input
it no longer keeps) and, outside autograd's saved tensors, the head weight's gradient.

Under TP the vocabulary is split (`VocabShard`): the row maximum and then the sum of
exponentials with the target logit are all-reduced over TP, per chunk, in forward only.

With a final logit soft-cap (`softcap`) each chunk's logits become cap * tanh(logit / cap)
before the softmax (transformers' order: divide, tanh, multiply); the chunk keeps the tanh in
one more fp32 (T, V) buffer until its gradient is multiplied by the cap's derivative,
1 - tanh^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """Rows `start` .. `start` + V / tp of the vocabulary, this rank's of the TP `group`."""

    start: int
    group: dist.ProcessGroup


def _loss_and_logit_grad_(
    work: torch.Tensor, targets: torch.Tensor, scale: float, vocab: VocabShard | None, grad: bool
) -> torch.Tensor:
    """The per-token loss (fp32, 0 where the target is -100) of the chunk's logits `work`
    (fp32 or wider); with `grad`, `work` becomes, in place, `scale` x the gradient of the
    summed loss with respect to those logits."""
    predicted = targets != -100
    width = work.shape[-1]
    if vocab is None:
        mine = predicted
        index = targets.clamp(min=0).unsqueeze(-1)
    else:
        local = targets - vocab.start
        mine = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1).unsqueeze(-1)
    peak = work.amax(dim=-1)
    if vocab is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=vocab.group)
    # The target's shifted logit, taken before `work` is overwritten (0 on the ranks that do
    # not hold the target's row).
    shifted_target = (work.gather(-1, index).squeeze(-1) - peak) * mine
    sum_exp = work.sub_(peak.unsqueeze(-1)).exp_().sum(dim=-1)
    if vocab is not None:
        packed = torch.stack([sum_exp, shifted_target])
        dist.all_reduce(packed, group=vocab.group)
        sum_exp, shifted_target = packed
    loss = (sum_exp.log() - shifted_target) * predicted
    if grad:
        # d/d logits of log(sum exp) - target logit: softmax - one-hot, on predicted rows only.
        work.div_(sum_exp.unsqueeze(-1))
        work.scatter_add_(-1, index, -mine.to(work.dtype).unsqueeze(-1))
        work.mul_((predicted.to(work.dtype) * scale).unsqueeze(-1))
    return loss


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        divisor: float,
        chunk_tokens: int,
        dtype: torch.dtype,
        vocab: VocabShard | None,
        grad: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        scale = 1.0 / divisor
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # one copy for every chunk (none when already in `dtype`)
            grad_hidden = (
                torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
                if grad and ctx.needs_input_grad[0]
                else None
            )
            grad_weight = (
                torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
                if grad and ctx.needs_input_grad[1]
                else None
            )
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                h = hidden[rows].to(dtype)
                logits = torch.mm(h, w.t())
                wide = logits.dtype in (torch.float32, torch.float64)
                work = logits if wide else logits.float()
                capped = None
                if softcap is not None:
                    capped = torch.div(work, softcap).tanh_()
                    work.copy_(capped).mul_(softcap)
                loss = _loss_and_logit_grad_(work, targets[rows], scale, vocab, grad)
                if capped is not None and grad:
                    work.mul_(capped.mul_(capped).neg_().add_(1))  # d(cap tanh(l / cap)) / dl
                del capped
                total = total + loss.sum()  # float64 logits keep a float64 total
                if not grad:
                    continue
                g = work if wide else logits.copy_(work)  # the gradient in the compute dtype
                del work
                if grad_hidden is not None:
                    if grad_hidden.dtype == dtype:
                        torch.mm(g, w, out=grad_hidden[rows])
                    else:
                        grad_hidden[rows] = torch.mm(g, w)
                if grad_weight is not None:
                    if grad_weight.dtype == dtype:
                        grad_weight.addmm_(g.t(), h)
                    else:
                        grad_weight += torch.mm(g.t(), h)
                del g, logits, h  # before the next chunk's, not after
        ctx.save_for_backward(grad_hidden)
        ctx.grad_weight = grad_weight  # a gradient, not an activation: outside saved tensors
        return total * scale

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        grad_weight, ctx.grad_weight = ctx.grad_weight, None
        # In place: these gradients are this Function's own; scaling by 1 changes nothing.
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_loss.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    divisor: float,
    chunk_tokens: int,
    vocab: VocabShard | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Sum over tokens of -log softmax(hidden @ weight.T)[target], divided by `divisor`;
    targets of -100 add nothing. The matmuls run in the autocast dtype when autocast is on,
    else in `hidden`'s; the softmax in fp32 (or wider). `vocab`: the TP shard of a
    vocabulary-parallel head (None: the whole vocabulary). `softcap`: the logits
    soft-capped, softcap * tanh(logit / softcap), before the softmax (None: not)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be (tokens, h) and targets (tokens,); got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedCrossEntropy.apply(
        hidden, weight, targets, float(divisor), chunk_tokens, dtype, vocab, grad, softcap
    )
