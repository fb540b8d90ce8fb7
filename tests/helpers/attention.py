"""The plain-math float64 attention reference of the cp tests (the multi-process launcher is
tests/helpers/dist.py, shared by every multi-process test)."""

from __future__ import annotations

import math

import torch


def math_attention(
    q,
    k,
    v,
    causal: bool,
    scale: float | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks=None,
    documents=None,
):
    """Plain-math attention in float64 (GQA by repeating K/V heads): ``(out, lse)``. With a
    sliding ``window`` (query i sees keys i - window < j <= i), soft-capped scores, a sink
    logit per head (in every denominator, no value) and ``documents`` (one boundary list per
    batch element: keys of the query's document only), as transformers' eager attention
    computes them."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    s_q, s_k = scores.shape[-2:]
    i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
    hidden = (j > i) if causal else torch.zeros(s_q, s_k, dtype=torch.bool)
    if window is not None:
        hidden = hidden | (i - j >= window)
    hidden = hidden.expand(q.size(0), 1, s_q, s_k)
    if documents is not None:
        ids = torch.stack(
            [torch.bucketize(torch.arange(s_q), torch.tensor(b[1:]), right=True) for b in documents]
        )
        hidden = hidden | (ids[:, None, :, None] != ids[:, None, None, :])
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(q.size(0), -1, s_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., :s_k] if sinks is not None else probs) @ v
    return out, lse


def reference_with_grads(q, k, v, grad_out, causal, scale=None, **extended):
    """Float64 reference: out, lse and (dq, dk, dv) for the upstream gradient ``grad_out``;
    with ``sinks`` among `extended`, their gradient too, as a fourth gradient."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks = extended.pop("sinks", None)
    if sinks is not None:
        sinks = sinks.detach().double().requires_grad_()
    out, lse = math_attention(q, k, v, causal, scale, sinks=sinks, **extended)
    out.backward(grad_out.double())
    grads = (q.grad, k.grad, v.grad) + ((sinks.grad,) if sinks is not None else ())
    return out.detach(), lse.detach(), grads
