# Shapes: q (B, Hq, S, D), k, v (B, Hkv, S, D) full sequence; out (B, Hq, S, D); lse (B, Hq, S) fp32.
"""Single-process full attention through the same kernels as the CP paths: the CP=1 path, and
the local attention inside Ulysses. Under a document mask: one kernel call per document (the
per-rectangle path), or one FlexAttention call over the whole sequence where
``kernels.masked_kernel()`` is "flex". A sliding window, soft-capped scores or attention sinks
run through the pieces of ``window.py`` (at one process: no exchange)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import flex, kernels
from .documents import CuSeqlens, batch_groups, check_documents
from .window import (
    WindowArgs,
    check_sinks,
    check_softcap,
    check_window,
    effective_window,
    window_attention_on,
)


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


class _DocumentAttention(torch.autograd.Function):
    """Causal attention within each document of a packed sequence: one kernel call per
    (batch group, document), on row slices; each row lies in one document, so forward writes
    and backward reads each piece's own final out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, documents: CuSeqlens, scale):
        out = torch.empty_like(q)
        # The kernels' lse is fp32, or fp64 for fp64 inputs.
        lse = q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))
        for batch, rows in _document_rows(documents):
            out[batch, :, rows], lse[batch, :, rows] = kernels.attention_forward(
                q[batch, :, rows], k[batch, :, rows], v[batch, :, rows], True, scale
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (documents, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        documents, scale = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for batch, rows in _document_rows(documents):
            dq[batch, :, rows], dk[batch, :, rows], dv[batch, :, rows] = kernels.attention_backward(
                grad_out[batch, :, rows],
                q[batch, :, rows],
                k[batch, :, rows],
                v[batch, :, rows],
                out[batch, :, rows],
                lse[batch, :, rows],
                True,
                scale,
            )
        return dq, dk, dv, None, None


class _OneCallDocumentAttention(torch.autograd.Function):
    """Causal attention within each document of a packed sequence in one FlexAttention call,
    forward and backward (the block mask is built once per batch and shared by every layer)."""

    @staticmethod
    def forward(ctx, q, k, v, documents: CuSeqlens, scale):
        mask = flex.MASKS.get(documents, None, 0, 0, (0, q.size(2)), q.device)
        out, lse = flex.block_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mask, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale = ctx.args
        dq, dk, dv = flex.block_backward(grad_out, q, k, v, out, lse, mask, scale)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def _document_rows(documents: CuSeqlens) -> list[tuple[slice, slice]]:
    return [
        (batch, slice(start, stop))
        for batch, bounds in batch_groups(documents)
        for start, stop in zip(bounds, bounds[1:], strict=False)
    ]


def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    documents: Sequence[Sequence[int]] | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Attention over the whole sequence in one process; differentiable.

    q (B, Hq, S, D), k and v (B, Hkv, S, D) with Hq % Hkv == 0 (GQA). ``scale`` defaults to
    1/sqrt(D). Returns out (q's dtype) or, with ``return_lse``, (out, lse fp32 (B, Hq, S)).
    ``documents`` (per batch element the document boundaries ``[0, ..., S]``): attend causally
    within each document only, each computed exactly as if run alone.
    ``window``: a local layer's sliding window (a query at i sees keys i - window < j <= i);
    ``softcap``: scores become ``softcap * tanh(score / softcap)``; ``sinks`` (Hq,): a learned
    logit per head in every row's softmax denominator (differentiable). All three need
    ``causal``.
    """
    kernels.check_qkv(q, k, v)
    cu = check_documents(documents, causal, q.size(0), q.size(2))
    if window is not None or softcap is not None or sinks is not None:
        check_extensions(causal, window, softcap, sinks, q.size(1))
        args = WindowArgs(
            None,
            None,
            cu,
            effective_window(window, q.size(2)),
            kernels.resolve_scale(q, scale),
            softcap,
        )
        return window_attention_on(q, k, v, args, sinks, return_lse)
    if cu is not None:
        one_call = kernels.masked_kernel(q.device) == "flex"
        attention = _OneCallDocumentAttention if one_call else _DocumentAttention
        out, lse = attention.apply(q, k, v, cu, kernels.resolve_scale(q, scale))
        return (out, lse) if return_lse else out
    out, lse = _FullAttention.apply(q, k, v, causal, kernels.resolve_scale(q, scale))
    return (out, lse) if return_lse else out


def check_extensions(
    causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    heads: int,
) -> None:
    """Raise ValueError for a window, soft-cap or sinks that are not well formed, or given
    without ``causal`` (every layer that has them is a causal decoder's)."""
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, heads)
    if not causal and (window is not None or softcap is not None or sinks is not None):
        raise ValueError("a window, soft-capped scores and attention sinks need causal=True")
