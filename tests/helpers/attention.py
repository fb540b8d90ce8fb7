"""The plain-math float64 attention reference of the cp tests (the multi-process launcher is
tests/helpers/dist.py, shared by every multi-process test)."""

from __future__ import annotations

import math

import torch


def math_attention(q, k, v, causal: bool, scale: float | None = None):
    """Plain-math attention in float64 (GQA by repeating K/V heads): ``(out, lse)``."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s_q, s_k = scores.shape[-2:]
        hidden = torch.ones(s_q, s_k, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    return out, lse


def reference_with_grads(q, k, v, grad_out, causal, scale=None):
    """Float64 reference: out, lse and (dq, dk, dv) for the upstream gradient ``grad_out``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = math_attention(q, k, v, causal, scale)
    out.backward(grad_out.double())
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)
