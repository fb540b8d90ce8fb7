# Shapes: out, block_out (B, H, Sq, D); lse, block_lse (B, H, Sq); out and lse: fp32 (fp64 for fp64) accumulators.
"""Merge a block's partial attention into the running result through the log-sum-exp."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold ``(block_out, block_lse)`` into the fp32 accumulators ``(out, lse)`` in place.

    The exact update is lse' = log(e^lse + e^blk) and out' = (e^lse out + e^blk blk_out) / e^lse'.
    Written with the sigmoid of the lse difference it never exponentiates a large number
    (ring-flash-attention's stable form): out' = out + sigmoid(blk - lse) (blk_out - out),
    lse' = lse - logsigmoid(lse - blk). ``out`` and ``lse`` may be views (a zigzag half-block).
    """
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.lerp_(block_out.to(out.dtype), weight)
    lse.sub_(F.logsigmoid(lse - block_lse))
