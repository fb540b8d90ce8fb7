# Shapes: q (B, Hq, Sq, D); k, v (B, Hkv, Sk, D) with Hq % Hkv == 0; out (B, Hq, Sq, D); lse (B, Hq, Sq) fp32.
"""The one place that calls attention kernels returning the log-sum-exp (what CP merging needs).

``attention_forward`` returns ``(out, lse)`` with lse the fp32 natural-log log-sum-exp of each
query row's scaled scores; ``attention_backward`` takes the *final* (merged) out and lse, which
is what lets a ring recompute each block's gradient independently. Causal masking is aligned
top-left; CP only asks for it on square (Sq == Sk) diagonal blocks, where alignments agree.

Two additions for local layers and soft-capped scores: ``mask``, an additive (Sq, Sk) mask in
q's dtype (0 where a key is seen, -inf where hidden; a sliding window's edge tile), which the
CPU flash kernel takes as it is; and ``softcap``, scores passed through ``cap * tanh(s / cap)``
before the softmax, which no flash kernel here supports: such calls (and masked ones on CUDA)
run the math kernel below, tiled over query rows, exact in fp32. Every row of a call must see
at least one key (the kernels give a fully hidden row lse 0, not -inf): callers cut their
tiles so (``window.py``).
"""

from __future__ import annotations

import math
import os

import torch

aten = torch.ops.aten

# Memory-efficient attention pads lse to a multiple of this many rows (CUDA only).
_EFFICIENT_LSE_ALIGN = 32


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are (B, H, S, D) tensors with compatible shapes and heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.size(0) != k.size(0) or q.size(3) != k.size(3):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head dim (dim 3)"
        )
    if q.size(1) % k.size(1) != 0:
        raise ValueError(
            f"query heads ({q.size(1)}) must be a multiple of key/value heads ({k.size(1)}) for GQA"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def resolve_scale(q: torch.Tensor, scale: float | None) -> float:
    """The softmax scale: ``scale`` if given, else 1/sqrt(head_dim) (SDPA's default)."""
    return 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over k, v: ``(out in q.dtype, lse fp32 (B, Hq, Sq))``. Inputs may be views.
    ``softcap``: scores soft-capped before the softmax; ``mask``: additive (Sq, Sk) in q's dtype."""
    if softcap is not None or (mask is not None and q.device.type != "cpu"):
        return _math_forward(q, k, v, causal, scale, softcap, mask)
    if mask is not None:
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    if q.device.type == "cpu":
        # The CPU flash kernel takes Hkv < Hq natively (GQA) and strided inputs as they are.
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
    return _cuda_forward(q, k, v, causal, scale)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block given the final ``out`` and ``lse`` of its query rows.

    dk and dv have k's Hkv heads (GQA heads summed), in k's dtype; only CUDA's memory-efficient
    path (fp32 inputs) returns them in fp32 under GQA. ``softcap`` and ``mask`` as in
    ``attention_forward``. The final lse may hold more than this block's keys (other blocks,
    attention sinks): the gradient is exact for any such lse.
    """
    if softcap is not None or (mask is not None and q.device.type != "cpu"):
        return _math_backward(grad_out, q, k, v, out, lse, causal, scale, softcap, mask)
    if mask is not None:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale
        )
    return _cuda_backward(grad_out, q, k, v, out, lse, causal, scale)


# --- the math kernel (soft-capped scores, masks on CUDA) -------------------------------------------
MATH_TILE_ROWS = 512
"""Query rows the math kernel computes at a time: its fp32 scores are (B, Hq, rows, Sk)."""


def _scores(q_rows, k, causal, scale, softcap, mask, first_row):
    """Scaled scores of q's rows `first_row`.. over k (both in the accumulator dtype, K/V
    heads expanded), soft-capped and masked: (raw tanh or None, scores)."""
    s = torch.matmul(q_rows, k.transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        # transformers' order: scale, divide by the cap, tanh, multiply by the cap.
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if causal:
        rows = torch.arange(first_row, first_row + s.size(-2), device=s.device)
        hidden = torch.arange(s.size(-1), device=s.device)[None, :] > rows[:, None]
        s = s.masked_fill(hidden, float("-inf"))
    if mask is not None:
        s = s + mask[first_row : first_row + s.size(-2)].to(s.dtype)
    return capped, s


def _math_forward(q, k, v, causal, scale, softcap, mask):
    acc = torch.promote_types(q.dtype, torch.float32)
    n_rep = q.size(1) // k.size(1)
    kx, vx = _expand_kv(k, n_rep).to(acc), _expand_kv(v, n_rep).to(acc)
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=acc)
    for first in range(0, q.size(2), MATH_TILE_ROWS):
        rows = slice(first, first + MATH_TILE_ROWS)
        _, s = _scores(q[:, :, rows].to(acc), kx, causal, scale, softcap, mask, first)
        block_lse = torch.logsumexp(s, dim=-1)
        out[:, :, rows] = torch.matmul(torch.exp(s - block_lse.unsqueeze(-1)), vx).to(q.dtype)
        lse[:, :, rows] = block_lse
    return out, lse


def _math_backward(grad_out, q, k, v, out, lse, causal, scale, softcap, mask):
    acc = torch.promote_types(q.dtype, torch.float32)
    n_rep = q.size(1) // k.size(1)
    kx, vx = _expand_kv(k, n_rep).to(acc), _expand_kv(v, n_rep).to(acc)
    dq = torch.empty_like(q)
    dkx = torch.zeros_like(kx)
    dvx = torch.zeros_like(vx)
    for first in range(0, q.size(2), MATH_TILE_ROWS):
        rows = slice(first, first + MATH_TILE_ROWS)
        q_rows, g_rows = q[:, :, rows].to(acc), grad_out[:, :, rows].to(acc)
        capped, s = _scores(q_rows, kx, causal, scale, softcap, mask, first)
        p = torch.exp(s - lse[:, :, rows].to(acc).unsqueeze(-1))
        dvx += torch.matmul(p.transpose(-1, -2), g_rows)
        # d softmax: p * (dO . v_j - dO . out), the row term over the final (merged) out.
        row_term = (g_rows * out[:, :, rows].to(acc)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(g_rows, vx.transpose(-1, -2)) - row_term)
        if capped is not None:
            ds = ds * (1 - capped * capped)  # d(cap * tanh(s / cap)) / ds
        dq[:, :, rows] = (torch.matmul(ds, kx) * scale).to(q.dtype)
        dkx += torch.matmul(ds.transpose(-1, -2), q_rows) * scale
    dk = dkx.unflatten(1, (k.size(1), n_rep)).sum(2) if n_rep > 1 else dkx
    dv = dvx.unflatten(1, (v.size(1), n_rep)).sum(2) if n_rep > 1 else dvx
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# --- CUDA ----------------------------------------------------------------------------------------
# Exercised only on GPU (this project's CI has none; `benchmarks/ring_counts.py` runs this code on
# meta tensors, whose kernels are torch's own shape functions). Written from the op schemas of
# torch 2.13:
#   _scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale)
#     -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
#   _scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k,
#     max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale) -> (dq, dk, dv)
#   _efficient_attention_forward / _efficient_attention_backward take (B, S, H, D) tensors and pad
#     lse to a multiple of 32 rows.
# Flash needs fp16/bf16 and head dim <= 256 divisible by 8; anything else (fp32) goes to the
# memory-efficient kernel. Flash (FlashAttention-2 inside torch) takes Hq % Hkv == 0 natively and
# returns dk/dv with k's Hkv heads in k's dtype, and it takes any strides whose last dimension is
# 1, so zigzag half-row slices go in as views: no K/V expansion and no copies on this path. Only
# the lse must be dense (the kernel indexes it as (B, H, Sq)); a half-row slice of it is B*H*Sq
# fp32 values. The memory-efficient kernel (the fp32 fallback) has no GQA and gets dense
# copies with expanded K/V; its dK/dV are summed back over each K/V head's query heads in fp32.


# Which 16-bit kernel runs: "flash" (torch's bundled FlashAttention-2, or FlashAttention-3 once
# `use_cuda_kernel("fa3")` activated it into the same op), or "cudnn" (cuDNN's fused attention,
# whose lse comes as (B, H, Sq, 1)). `ctxlaunch.cp.kernel_choice` picks one by measurement.
CUDA_KERNELS = ("flash", "cudnn", "fa3")
_cuda_kernel = "flash"


def use_cuda_kernel(name: str) -> None:
    """Run the 16-bit CUDA calls on kernel `name` (one of CUDA_KERNELS) from now on. "fa3"
    activates torch's FlashAttention-3 registration (`torch.nn.attention`; it needs the
    `flash_attn_interface` package and a Hopper GPU, and raises where either is missing) and
    then calls the flash op, which dispatches to it; leaving "fa3" restores FlashAttention-2."""
    global _cuda_kernel
    if name not in CUDA_KERNELS:
        raise ValueError(f"attention kernel {name!r}: expected one of {', '.join(CUDA_KERNELS)}")
    from torch.nn import attention

    if name == "fa3" and attention.current_flash_attention_impl() != "FA3":
        attention.activate_flash_attention_impl("FA3")
    elif name != "fa3" and attention.current_flash_attention_impl() == "FA3":
        attention.restore_flash_attention_impl()
    _cuda_kernel = name


# How a document-masked block runs: "rectangles" (one dense kernel call per (query run, K/V
# run, document) rectangle: `documents.block_pieces`, the reference) or "flex" (one
# FlexAttention call per block with a block mask: `flex.py`). "auto": flex on CUDA, rectangles
# elsewhere (on the CPU FlexAttention has only torch's dense reference implementation).
MASKED_KERNELS = ("rectangles", "flex")
MASKED_ENV = "CTXLAUNCH_MASKED_ATTENTION"
"""auto, or one of MASKED_KERNELS."""
_masked_kernel = os.environ.get(MASKED_ENV, "auto")


def use_masked_kernel(name: str) -> None:
    """Run document-masked blocks on `name` ("auto" or one of MASKED_KERNELS) from now on."""
    global _masked_kernel
    if name != "auto" and name not in MASKED_KERNELS:
        raise ValueError(
            f"masked attention {name!r}: expected auto or one of {', '.join(MASKED_KERNELS)}"
        )
    _masked_kernel = name


def masked_kernel(device: torch.device) -> str:
    """How document-masked blocks on `device` run: "flex" or "rectangles"."""
    if _masked_kernel == "auto":
        return "flex" if device.type == "cuda" else "rectangles"
    if _masked_kernel not in MASKED_KERNELS:
        raise ValueError(
            f"{MASKED_ENV}={_masked_kernel!r}: expected auto or one of {', '.join(MASKED_KERNELS)}"
        )
    return _masked_kernel


def _use_flash(q: torch.Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) <= 256 and q.size(-1) % 8 == 0


def cuda_kernel_name(q: torch.Tensor) -> str:
    """The kernel ``attention_forward``/``attention_backward`` call for CUDA queries like ``q``."""
    return _cuda_kernel if _use_flash(q) else "memory-efficient"


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _reduce_kv_grad(dx: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return dx
    return dx.unflatten(1, (dx.size(1) // n_rep, n_rep)).sum(2, dtype=torch.float32)


def _cuda_forward(q, k, v, causal, scale):
    if _use_flash(q) and _cuda_kernel == "cudnn":
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.view(lse.shape[:3])
    if _use_flash(q):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse
    n_rep = q.size(1) // k.size(1)
    q, k, v = q.contiguous(), _expand_kv(k, n_rep).contiguous(), _expand_kv(v, n_rep).contiguous()
    out, lse, *_ = aten._efficient_attention_forward(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        None,
        None,
        None,
        None,
        None,
        0.0,
        int(causal),
        True,
        scale=scale,
    )
    return out.transpose(1, 2), lse[..., : q.size(2)]


def _cuda_backward(grad_out, q, k, v, out, lse, causal, scale):
    sq, sk = q.size(2), k.size(2)
    lse = lse.contiguous()
    # Dropout is 0, so the kernels never read the RNG state.
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)
    if _use_flash(q) and _cuda_kernel == "cudnn":
        # No bias, dense inputs (no cumulative lengths), no dropout (the seeds are never read).
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse.unsqueeze(-1),
            no_rng,
            no_rng,
            None,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            scale=scale,
        )
    if _use_flash(q):
        # cum_seq_q/k are None for dense (non-nested) inputs.
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            no_rng,
            no_rng,
            scale=scale,
        )
    n_rep = q.size(1) // k.size(1)
    q, k, v = q.contiguous(), _expand_kv(k, n_rep).contiguous(), _expand_kv(v, n_rep).contiguous()
    grad_out, out = grad_out.contiguous(), out.contiguous()
    padded = -(-sq // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
    lse = torch.nn.functional.pad(lse, (0, padded - sq))
    dq, dk, dv, _ = aten._efficient_attention_backward(
        grad_out.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        None,
        out.transpose(1, 2),
        None,
        None,
        sq,
        sk,
        lse,
        0.0,
        no_rng,
        no_rng,
        int(causal),
        False,
        scale=scale,
    )
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, _reduce_kv_grad(dk, n_rep), _reduce_kv_grad(dv, n_rep)
