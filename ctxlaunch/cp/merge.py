# Shapes: out, block_out (B, H, Sq, D); lse, block_lse (B, H, Sq); out and lse: fp32 (fp64 for fp64) accumulators.
"""Merge a block's partial attention into the running result through the log-sum-exp.

The exact update is lse' = log(e^lse + e^blk) and out' = (e^lse out + e^blk blk_out) / e^lse'
= out + sigmoid(blk - lse) (blk_out - out). Both are written so that nothing large is
exponentiated: the weight is a sigmoid of the lse difference and lse' is ``logaddexp``
(max + log1p(e^-|d|)).

``merge_block`` runs it in place on the accumulators, which may be views (a zigzag half-block).
On CUDA the math is compiled (``torch.compile``, Inductor): one pass that reads ``out``,
``block_out`` and the two lse and writes ``out`` and ``lse`` in place, converting ``block_out`` to
fp32 in registers. Elsewhere (and on CUDA with ``CTXLAUNCH_CP_FUSED_MERGE=0`` or
``set_fused_merge(False)``) it is five in-place eager ops into a ``MergeScratch``, which
allocates nothing once the scratch exists.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch

_fused_enabled = os.environ.get("CTXLAUNCH_CP_FUSED_MERGE", "1") != "0"


def set_fused_merge(enabled: bool) -> None:
    """Switch the compiled merge on CUDA on or off (the default is on)."""
    global _fused_enabled
    _fused_enabled = bool(enabled)


class MergeScratch:
    """Reusable fp32 buffers for the eager merge: a weight per row and one block of out."""

    def __init__(self, out: torch.Tensor):
        self.rows = out.new_empty(out.shape[:-1])
        self.block = out.new_empty(out.shape)

    @staticmethod
    def take(buffer: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return buffer.view(-1)[: math.prod(shape)].view(shape)


def merge_block(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    scratch: MergeScratch | None = None,
) -> None:
    """Fold ``(block_out, block_lse)`` into the fp32 accumulators ``(out, lse)`` in place.

    ``block_out`` may have a lower dtype. Without ``scratch`` the eager form allocates its two
    temporaries per call; the fused CUDA form needs none.
    """
    global _fused_enabled
    if out.is_cuda and _fused_enabled:
        try:
            fused_merge()(out, lse, block_out, block_lse)
            return
        except Exception as exc:  # noqa: BLE001 - no compiler here: the eager merge is exact too
            # Compiling fails before the compiled pass has written anything.
            _fused_enabled = False
            warnings.warn(
                f"ctxlaunch.cp: the compiled ring merge failed ({exc!r}); merging "
                "eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
    scratch = scratch if scratch is not None else MergeScratch(out)
    weight = MergeScratch.take(scratch.rows, lse.shape)
    block = MergeScratch.take(scratch.block, out.shape)
    torch.sub(block_lse, lse, out=weight)
    weight.sigmoid_()
    block.copy_(block_out)  # lerp_ takes one dtype
    out.lerp_(block, weight.unsqueeze(-1))
    torch.logaddexp(lse, block_lse, out=lse)


def merge_math(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """The merge as one functional expression, written back in place (what ``fused_merge``
    compiles)."""
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.add_(weight * (block_out.to(out.dtype) - out))
    lse.copy_(torch.logaddexp(lse, block_lse))


@functools.cache
def fused_merge():
    """``merge_math`` compiled once per process (recompiled per distinct shape and stride set,
    of which an unmasked ring has two: the whole shard and its halves)."""
    return torch.compile(merge_math, fullgraph=True)


# -- attention sinks --------------------------------------------------------------------------------
# A sink is a learned logit per head that joins every row's softmax denominator and carries no
# value: merged once, after every block, as a block whose lse is the sink and whose out is 0.
def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold the per-head sink logits ``sinks`` (H,) into the merged fp32 accumulators in place:
    lse' = log(e^lse + e^sink), out' = out * e^(lse - lse')."""
    sink = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    out.mul_(torch.sigmoid(lse - sink).unsqueeze(-1))
    torch.logaddexp(lse, sink, out=lse)


def sink_gradient(
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """The gradient of the sinks (H,) from these rows, given the final out and lse (sinks
    folded in): d sink_h = -sum over rows of e^(sink_h - lse) (dO . out)."""
    acc = lse.dtype
    weight = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
    row_term = (grad_out.to(acc) * out.to(acc)).sum(-1)
    return -(weight * row_term).sum(dim=(0, 2)).to(sinks.dtype)
