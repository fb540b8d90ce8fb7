# Shapes: q (B, Hq, S, D), k, v (B, Hkv, S, D) full sequence; out (B, Hq, S, D); lse (B, Hq, S) fp32.
"""Single-process full attention through the same kernels as the CP paths: the CP=1 path, and
the local attention inside Ulysses."""

from __future__ import annotations

import torch

from . import kernels


class _FullAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = kernels.attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = kernels.attention_backward(grad_out, q, k, v, out, lse, *ctx.args)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Attention over the whole sequence in one process; differentiable.

    q (B, Hq, S, D), k and v (B, Hkv, S, D) with Hq % Hkv == 0 (GQA). ``scale`` defaults to
    1/sqrt(D). Returns out (q's dtype) or, with ``return_lse``, (out, lse fp32 (B, Hq, S)).
    """
    kernels.check_qkv(q, k, v)
    out, lse = _FullAttention.apply(q, k, v, causal, kernels.resolve_scale(q, scale))
    return (out, lse) if return_lse else out
