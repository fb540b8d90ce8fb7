# Shapes: tokens (B, S) with S the tokens this rank holds (S = seq_len / CP); hidden (B, S, h);
# attention tensors in SDPA layout (B, H, S, D).
"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU; with the parts a
family may add to it (contract/families/family.py): biases on the q, k and v projections, an
RMSNorm over each head of q and of k before RoPE, and a head width free of hidden / heads.

The model never touches a process group. Which attention runs (full, ring, Ulysses, hybrid) is
`Attention.attend`, installed by `parallelize`; positions come in with the tokens, so RoPE
follows each token's global position under any CP layout (or, per sequence, its position in
its document); a packed batch's document boundaries, when given, pass through to `attend`.
A family's mixture-of-experts blocks have `moe.MoEFeedForward` as their `ffn` (the router, the
experts and their dispatch, which `parallelize` installs as it installs attention), and the
model's `routing` records what they route for the load-balancing loss (moe.py).
Tensor parallelism enters the same way: `project_in`/`exit` around attention and the
feed-forward (the input projection and identity by default; under TP the sequence all-gather
fused with the column-parallel projection, and the reduce-scatter), `chunked_loss`
for the vocabulary-parallel loss (loss.py: forward and backward per chunk of tokens).

What each block saves for backward is deliberate (the planner's constants in
ctxlaunch/memory.py are derived from it): RMSNorm keeps only its input and the fp32 reciprocal
RMS; SwiGLU keeps gate and up and recomputes the SiLU in backward; attention keeps q, k, v, its
output and the log-sum-exp (the flash kernels keep no s-by-s matrix). The q/k norms keep
their input, which is a view of the fused q/k/v projection's output (so that whole output
stays), and their fp32 reciprocal RMS; the biases keep nothing (their gradient is the output
gradient summed over tokens).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ctxlaunch.contract.families.experts import ExpertsShape
from ctxlaunch.contract.spec import (
    DefaultRope,
    LinearRope,
    Llama3Rope,
    ModelSpec,
    RopeScaling,
    YarnRope,
)
from ctxlaunch.perf.memory import BACKWARD_CHUNK_TOKENS, LOSS_CHUNK_TOKENS
from ctxlaunch.runtime.modeling.loss import chunked_cross_entropy
from ctxlaunch.runtime.modeling.moe import MoEFeedForward, Routing
from ctxlaunch.runtime.modeling.tiling import tiled_feed_forward

AttentionFn = Callable[..., torch.Tensor]
"""attend(q, k, v) or, under a document mask, attend(q, k, v, documents=...) -> out."""
Documents = tuple[tuple[int, ...], ...] | None
"""Per sequence, the global document boundaries of a packed batch (None: no document mask)."""
Hook = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _project(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    return linear(x)


def _keep_input(x: torch.Tensor) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


ProjectIn = Callable[[torch.Tensor, nn.Linear], torch.Tensor]
"""project_in(x, linear) -> the block half's input projection of x (gathered under TP)."""


def _token_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and whether the target is the arg-max (targets -100: loss 0, False)."""
    loss = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
    return loss, logits.argmax(dim=-1) == targets


Checkpointing = Literal["none", "selective", "full"]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or as it is if wider (float64, for exactness checks)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _row_chunks(rows: int) -> Iterator[slice]:
    """Token rows in chunks of BACKWARD_CHUNK_TOKENS: the fp32 temporaries of the pointwise
    backward passes below exist for one chunk at a time."""
    for start in range(0, rows, BACKWARD_CHUNK_TOKENS):
        yield slice(start, start + BACKWARD_CHUNK_TOKENS)


# -- compiled pointwise math (training.compile) -----------------------------------------------
# Each function below is the whole pointwise body of one step of RMSNorm, SwiGLU or RoPE, so
# that inductor fuses it into one kernel (no fp32 temporaries in memory). The autograd
# Functions keep what they save and their token chunks: compiling changes only how one chunk
# is computed, so the planner's constants still hold (its count of the eager backward's fp32
# temporaries becomes an upper bound). Attention and the matmuls are never compiled.
def _rms_forward_math(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = _upcast(x)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * _upcast(weight)).to(x.dtype), rstd


def _rms_backward_math(
    x: torch.Tensor, grad_y: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x in x's dtype, the gain's gradient summed over these rows, fp32) of rows."""
    normed = _upcast(x) * rstd
    g32 = _upcast(grad_y)
    gw = g32 * _upcast(weight)
    mean = (gw * normed).mean(-1, keepdim=True)
    return ((gw - normed * mean) * rstd).to(x.dtype), (g32 * normed).sum(0)


def _swiglu_forward_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu_backward_math(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of rows, computed in fp32, in the inputs' dtype."""
    g32, dy32 = _upcast(gate), _upcast(dy)
    sig = torch.sigmoid(g32)
    grad_up = g32 * sig * dy32
    grad_gate = sig * (1 + g32 * (1 - sig)) * dy32 * _upcast(up)
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def _apply_rope_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


_EAGER_POINTWISE: dict[str, Callable[..., Any]] = {
    "rms_forward": _rms_forward_math,
    "rms_backward": _rms_backward_math,
    "swiglu_forward": _swiglu_forward_math,
    "swiglu_backward": _swiglu_backward_math,
    "rope": _apply_rope_math,
}
_compiled_pointwise: dict[str, Callable[..., Any]] = {}
_POINTWISE: dict[str, Callable[..., Any]] | None = None
"""The compiled kernels while `set_compiled(True)` holds, else None (the eager code below)."""


def set_compiled(enabled: bool) -> None:
    """Run the pointwise work of every block through torch.compile (`enabled`) or eagerly.
    Process-wide: the autograd Functions are static. Each function is compiled once per input
    shape and dtype, on first use (fullgraph; attention stays outside every compiled region)."""
    global _POINTWISE
    if enabled and not _compiled_pointwise:
        for name, fn in _EAGER_POINTWISE.items():
            _compiled_pointwise[name] = torch.compile(fn, fullgraph=True, dynamic=False)
    _POINTWISE = _compiled_pointwise if enabled else None


def _pointwise(name: str) -> Callable[..., Any]:
    return (_POINTWISE or _EAGER_POINTWISE)[name]


def compiled() -> bool:
    """Whether the pointwise work runs compiled (`set_compiled`)."""
    return _POINTWISE is not None


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w, in fp32 inside; saves x and the fp32 1/rms only. Backward computes
    in fp32 over chunks of tokens, so its fp32 temporaries are (chunk x h), not (tokens x h)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _pointwise("rms_forward")(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, g2, rstd2 = x.reshape(-1, h), grad_y.reshape(-1, h), rstd.reshape(-1, 1)
        grad_x = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        grad_weight = torch.zeros(h, dtype=rstd.dtype, device=x.device)
        kernel = None if _POINTWISE is None else _POINTWISE["rms_backward"]
        w32 = _upcast(weight)
        for rows in _row_chunks(x2.shape[0]):
            if kernel is not None:
                grad_x[rows], gw_rows = kernel(x2[rows], g2[rows], rstd2[rows], weight)
                grad_weight += gw_rows
                continue
            r = rstd2[rows]
            normed = _upcast(x2[rows]) * r
            g32 = _upcast(g2[rows])
            gw = g32 * normed
            grad_weight += gw.sum(0)
            torch.mul(g32, w32, out=gw)
            # d/dx of x * rstd: rstd * (gw - normed * mean(gw * normed))
            mean = (gw * normed).mean(-1, keepdim=True)
            grad_x[rows] = gw.sub_(normed.mul_(mean)).mul_(r)
            del normed, g32, gw, mean  # before the next chunk's, not after
        return grad_x.view(x.shape), grad_weight.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the norm runs in the input's dtype (fp32 residual), as the planner counts.
        with torch.autocast(device_type=x.device.type, enabled=False):
            return _RMSNorm.apply(x, self.weight, self.eps)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up; saves gate and up, recomputes the SiLU in backward. Backward computes
    in fp32 over chunks of tokens, in place, so its fp32 temporaries are two (chunk x ffn)
    tensors (four in 16-bit, with the upcasts of gate and grad), not eight (tokens x ffn)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _pointwise("swiglu_forward")(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        f = gate.shape[-1]
        gate2, up2, grad2 = gate.reshape(-1, f), up.reshape(-1, f), grad.reshape(-1, f)
        grad_gate = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
        grad_up = torch.empty(up2.shape, dtype=up.dtype, device=up.device)
        kernel = None if _POINTWISE is None else _POINTWISE["swiglu_backward"]
        for rows in _row_chunks(gate2.shape[0]):
            if kernel is not None:
                grad_gate[rows], grad_up[rows] = kernel(gate2[rows], up2[rows], grad2[rows])
                continue
            g32 = _upcast(gate2[rows])
            sig = torch.sigmoid(g32)
            dy = _upcast(grad2[rows])
            work = torch.mul(g32, sig)  # silu
            grad_up[rows] = work.mul_(dy)
            # d silu / d gate = sig * (1 + gate * (1 - sig))
            work.fill_(1).sub_(sig).mul_(g32).add_(1).mul_(sig)
            del g32, sig  # an in-place op with a 16-bit operand would upcast it into a new
            # temporary: upcast up explicitly, once these two are gone
            grad_gate[rows] = work.mul_(dy).mul_(_upcast(up2[rows]))
            del dy, work  # before the next chunk's, not after
        return grad_gate.view(gate.shape), grad_up.view(up.shape)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling
) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies (head_dim / 2, fp32) and the factor cos and sin are
    multiplied by, computed as transformers' `ROPE_INIT_FUNCTIONS` do, in fp32 like them, so
    an imported model's logits match transformers' (modeling_rope_utils.py, 5.x)."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (theta**exponents)
    if isinstance(scaling, LinearRope):
        return inv_freq / scaling.factor, 1.0
    if isinstance(scaling, Llama3Rope):
        factor, old_len = scaling.factor, scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if isinstance(scaling, YarnRope):
        return _yarn(dim, theta, scaling)
    return inv_freq, 1.0


def _yarn(dim: int, theta: float, scaling: YarnRope) -> tuple[torch.Tensor, float]:
    factor = scaling.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = get_mscale(factor, scaling.mscale) / get_mscale(
                factor, scaling.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (
            dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_share = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share
    return inv_freq, float(attention_factor)


def rope_tables(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (S, head_dim), or (B, S, head_dim) for per-sequence positions (B, S), for
    the given token positions (rotate-half layout).

    Computed exactly as transformers' LlamaRotaryEmbedding does, in fp32 throughout (inverse
    frequencies, position x frequency, cos/sin times the attention factor): an imported model
    then sees the tables it was trained and is served with, bit for bit. (fp64 angles would be
    closer to the true rotation at long context, but differ from those tables by up to
    position x 6e-8 radians.) Each token's table depends only on its own position, so every CP
    layout gets the same values."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling or DefaultRope())
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, S, H, D) by the tables (S, D) or (B, S, D)."""
    return _pointwise("rope")(x, cos, sin)


class Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int | None = None,
        *,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = head_dim or hidden // heads
        self.wqkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        # One gain of head_dim for every head (the q/k norms): under TP each rank applies it to its own
        # heads, and under Ulysses before the all-to-all, while every head is still local.
        self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.attend: AttentionFn = _local_attention
        self.project_in: ProjectIn = _project
        self.exit: Hook = _identity

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents = None
    ) -> torch.Tensor:
        qkv = self.project_in(x, self.wqkv)
        b, s, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k = q.view(b, s, self.heads, d), k.view(b, s, self.kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        q = apply_rope(q, cos, sin).transpose(1, 2).contiguous()
        k = apply_rope(k, cos, sin).transpose(1, 2).contiguous()
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2).contiguous()
        out = (
            self.attend(q, k, v) if documents is None else self.attend(q, k, v, documents=documents)
        )
        return self.exit(self.wo(out.transpose(1, 2).reshape(b, s, self.heads * d)))


def _draw(key: str, shape: torch.Size | tuple[int, ...], std: float) -> torch.Tensor:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(shape, generator=generator) * std


def _moe_feed_forward(
    hidden: int, moe: ExpertsShape | None, shared_expert: bool, layer: int
) -> MoEFeedForward | None:
    """Block `layer`'s mixture-of-experts feed-forward, where `moe` makes it one."""
    if moe is None or not moe.is_moe_layer(layer):
        return None
    shared = (
        FeedForward(hidden, moe.shared_ffn_hidden)
        if shared_expert and moe.shared_ffn_hidden
        else None
    )
    return MoEFeedForward(
        hidden, moe, renormalise=moe.norm_topk_prob, swiglu=_SwiGLU.apply, shared=shared
    )


def _local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents = None
) -> torch.Tensor:
    from ctxlaunch.cp import full_attention

    return full_attention(q, k, v, causal=True, documents=documents)


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.ffn_hidden = ffn_hidden
        self.w_gate_up = nn.Linear(hidden, 2 * ffn_hidden, bias=False)
        self.w_down = nn.Linear(ffn_hidden, hidden, bias=False)
        self.project_in: ProjectIn = _project
        self.exit: Hook = _identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_in(x, self.w_gate_up).chunk(2, dim=-1)
        return self.exit(self.w_down(_SwiGLU.apply(gate, up)))


class Block(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        ffn_hidden: int,
        eps: float,
        *,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        ffn: nn.Module | None = None,
    ):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = Attention(
            hidden, heads, kv_heads, head_dim, qkv_bias=qkv_bias, qk_norm=qk_norm, eps=eps
        )
        self.ffn_norm = RMSNorm(hidden, eps)
        # A mixture of experts where the model says (moe.MoEFeedForward), else the dense SwiGLU.
        self.ffn: nn.Module = ffn if ffn is not None else FeedForward(hidden, ffn_hidden)
        self.checkpointing: Checkpointing = "none"
        self.mlp_tile_tokens: int | None = None
        """The feed-forward half over tiles of this many tokens (tiling.py); None: whole."""
        self.offload_input: Callable[[torch.Tensor], AbstractContextManager[None]] = _keep_input
        """Around the full checkpoint, given the block's input: where the input it saves is
        kept (on the device; `parallelize` installs offload.py's host-memory offload)."""

    def _feed_forward_tile(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.ffn_norm(x))

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp_tile_tokens:
            params = [*self.ffn_norm.parameters(), *self.ffn.parameters()]
            return x + tiled_feed_forward(self._feed_forward_tile, x, self.mlp_tile_tokens, params)
        return x + self.ffn(self.ffn_norm(x))

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, documents)
        if self.checkpointing == "selective" and not self.mlp_tile_tokens:
            # Recompute the feed-forward half (linear in s, cheap); keep attention (quadratic
            # in s to recompute). Tiled, it already keeps only its input and recomputes.
            return checkpoint(self._feed_forward, x, use_reentrant=False)
        return self._feed_forward(x)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents = None
    ) -> torch.Tensor:
        if self.checkpointing == "full":
            with self.offload_input(x):
                return checkpoint(self._forward, x, cos, sin, documents, use_reentrant=False)
        return self._forward(x, cos, sin, documents)


class Transformer(nn.Module):
    """The decoder. `forward(tokens, positions, targets)` returns the mean next-token loss over
    this rank's tokens."""

    def __init__(
        self,
        *,
        layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        ffn_hidden: int,
        vocab: int,
        rope_theta: float,
        norm_eps: float,
        tie_embeddings: bool,
        rope_scaling: RopeScaling | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        moe: ExpertsShape | None = None,
        shared_expert: bool = False,
    ):
        super().__init__()
        self.hidden = hidden
        self.head_dim = head_dim or hidden // heads
        self.rope_theta = rope_theta
        self.rope_scaling: RopeScaling = rope_scaling or DefaultRope()
        # The embedding, norm and head are None on pipeline ranks that do not run them; the
        # embedding is vocabulary-parallel under TP.
        self.embed: nn.Module | None = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            Block(
                hidden,
                heads,
                kv_heads,
                ffn_hidden,
                norm_eps,
                head_dim=self.head_dim,
                qkv_bias=qkv_bias,
                qk_norm=qk_norm,
                ffn=_moe_feed_forward(hidden, moe, shared_expert, i),
            )
            for i in range(layers)
        )
        for index, ffn in enumerate(
            b.ffn for b in self.blocks if isinstance(b, Block) and isinstance(b.ffn, MoEFeedForward)
        ):
            ffn.index = index
        self.routing: Routing | None = (
            None
            if moe is None
            else Routing(
                moe.experts,
                len([i for i in range(layers) if moe.is_moe_layer(i)]),
                moe.aux_loss_coef,
                hidden,
            )
        )
        """The load-balancing loss's records of a mixture-of-experts model (moe.py)."""
        self.norm: RMSNorm | None = RMSNorm(hidden, norm_eps)
        self.head: nn.Linear | None = (
            None if tie_embeddings else nn.Linear(hidden, vocab, bias=False)
        )
        self.loss_chunk_tokens = LOSS_CHUNK_TOKENS
        self.enter_loss: Hook = _identity
        """(B, S/t, h) -> (B, S, h) under TP: every TP rank scores every token."""
        self.chunked_loss: Callable[..., torch.Tensor] = chunked_cross_entropy
        """loss(hidden, weight, targets, divisor=, chunk_tokens=): `chunked_cross_entropy`,
        vocabulary-parallel under TP."""
        self.token_scorer: Callable[
            [torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
        ] = _token_scores
        """Forward-only per-token scores of fp32 logits (vocabulary-parallel under TP)."""
        self.loss_divisor: float | None = None
        """What `loss` divides its summed loss by; an engine sets it each step (the step's
        global predicted-token count over the ranks and micro-batches whose gradients are
        averaged), so the averaged gradient is that of the step's token mean."""

    @classmethod
    def from_spec(cls, model: ModelSpec) -> Transformer:
        """The decoder the spec's model section describes (on the current default device)."""
        return cls(
            layers=model.layers,
            hidden=model.hidden,
            heads=model.heads,
            kv_heads=model.kv_heads,
            ffn_hidden=model.ffn_hidden,
            vocab=model.vocab,
            rope_theta=model.rope_theta,
            norm_eps=model.norm_eps,
            tie_embeddings=model.tie_embeddings,
            rope_scaling=model.rope_scaling,
            head_dim=model.head_dim,
            qkv_bias=model.qkv_bias,
            qk_norm=model.qk_norm,
            moe=model.moe,
            shared_expert=model.shared_expert,
        )

    def initial_value(
        self,
        name: str,
        shape: torch.Size,
        seed: int,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The initial fp32 value (CPU) of the whole parameter `name`, from a generator seeded
        by (seed, name): the same at every layout, and computable for one parameter without
        the others, so a rank draws only the parameters it holds; of an expert parameter only
        the `experts` (first, count) it holds, each from its own generator."""
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        std = 0.02
        if name.endswith(("wo.weight", "w_down.weight", "experts.w_down")):
            std = std / (2 * len(self.blocks)) ** 0.5  # residual branches, GPT-2 style
        if name.endswith(("experts.w_gate_up", "experts.w_down")):
            # One generator per expert: a rank holding some of the experts draws only those.
            first, count = experts if experts is not None else (0, shape[0])
            return torch.stack(
                [_draw(f"{seed}/{name}/{j}", shape[1:], std) for j in range(first, first + count)]
            )
        return _draw(f"{seed}/{name}", shape, std)

    def init_weights(self, seed: int) -> None:
        """Initialise a whole (unsharded, materialised) model: `initial_value` of each
        parameter."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(self.initial_value(name, param.shape, seed))

    def block_modules(self) -> list[Block]:
        """The blocks this rank holds (after a pipeline split the others are Identity)."""
        return [block for block in self.blocks if isinstance(block, Block)]

    def set_checkpointing(self, mode: Checkpointing) -> None:
        """Activation checkpointing of every block (see `Block`)."""
        for block in self.block_modules():
            block.checkpointing = mode

    def set_mlp_tiling(self, tile_tokens: int | None) -> None:
        """The feed-forward of every block over tiles of `tile_tokens` tokens (None: whole)."""
        for block in self.block_modules():
            block.mlp_tile_tokens = tile_tokens

    def run_blocks(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        blocks: Iterable[Block],
        documents: Documents = None,
        *,
        receives: bool = False,
        sends: bool = False,
    ) -> torch.Tensor:
        """The blocks over x. Under pipeline parallelism a stage that `receives` hidden states
        and one that `sends` them on exchange the mixture-of-experts router counts with them
        (moe.py); the last part closes the load-balancing loss's statistics."""
        blocks = list(blocks)
        routing = self.routing
        record = routing.begin(blocks) if routing is not None else None
        if receives and routing is not None:
            x = routing.receive_counts(x, record)
        x = self._blocks(x, positions, blocks, documents)
        if routing is not None and record is not None:
            x = routing.end(record, blocks, x, last=not sends)
        if sends and routing is not None:
            x = routing.send_counts(x, record)
        return x

    def _blocks(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        blocks: list[Block],
        documents: Documents = None,
    ) -> torch.Tensor:
        # Tables in the dtype q and k will have (autocast's, if on), made once for all blocks.
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, dtype, self.rope_scaling)
        for block in blocks:
            x = block(x, cos, sin, documents)
        return x

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor, documents: Documents = None
    ) -> torch.Tensor:
        """The final (normed) hidden states of the whole model (no pipeline split)."""
        if self.embed is None or self.norm is None:
            raise RuntimeError(
                "hidden_states needs the whole model; this one is a pipeline rank's part"
            )
        return self.norm(
            self.run_blocks(self.embed(tokens), positions, self.block_modules(), documents)
        )

    def _output_weight(self) -> torch.Tensor:
        owner = self.embed if self.head is None else self.head
        weight = getattr(owner, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise RuntimeError("this pipeline rank holds no output head")
        return weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        targets: torch.Tensor,
        documents: Documents = None,
        scores: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The mean loss; with `scores`, forward-only per-token scores instead (evaluation;
        through forward so that FSDP's and DeepSpeed's hooks gather the weights)."""
        hidden = self.hidden_states(tokens, positions, documents)
        return self.token_scores(hidden, targets) if scores else self.loss(hidden, targets)

    @torch.no_grad()
    def token_scores(
        self, hidden: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-token loss fp32, target is the arg-max) of every token of this CP rank, in
        its order, flattened over the batch; one logits chunk at a time."""
        hidden = self.enter_loss(hidden).flatten(0, 1)
        targets = targets.flatten()
        losses, hits = [], []
        for start in range(0, hidden.shape[0], self.loss_chunk_tokens):
            end = start + self.loss_chunk_tokens
            logits = F.linear(hidden[start:end], self._output_weight()).float()
            loss, hit = self.token_scorer(logits, targets[start:end])
            losses.append(loss)
            hits.append(hit)
        return torch.cat(losses), torch.cat(hits)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token loss of the final (normed) hidden states: the sum over the predicted
        targets (those not -100) divided by `loss_divisor`, or by their count when it is
        None (the mean over this rank's predicted tokens)."""
        hidden = self.enter_loss(hidden).flatten(0, 1)
        targets = targets.flatten()
        divisor = (
            self.loss_divisor
            if self.loss_divisor is not None
            else max(int((targets != -100).sum()), 1)
        )
        # The (tokens x vocab) logits exist one chunk at a time, each chunk's backward done in
        # its forward (loss.py).
        return self.chunked_loss(
            hidden,
            self._output_weight(),
            targets,
            divisor=divisor,
            chunk_tokens=self.loss_chunk_tokens,
        )
