# Shapes: tokens (B, S) with S the tokens this rank holds (S = seq_len / CP); hidden (B, S, h);
# attention tensors in SDPA layout (B, H, S, D).
"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU; with the parts a
family may add to it (contract/families/family.py): biases on the q, k and v projections (and
on o), an
RMSNorm over each head of q and of k before RoPE, a head width free of hidden / heads, norm
gains applied as 1 + w, norms after each sub-block, GeGLU, an embedding scaled by
sqrt(hidden), attention sinks; and per layer its attention kind: full, or local with its
sliding window (and the local layers' own RoPE base), with scores scaled and soft-capped as
the spec says, and the output logits soft-capped before the loss.

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
for the vocabulary-parallel loss (loss.py: forward and backward per chunk of tokens). A
layer's window, scale, soft-cap and sinks are arguments of `attend`, so one attention
function serves local and full layers alike.

What each block saves for backward is deliberate (the planner's constants in
ctxlaunch/memory.py are derived from it): RMSNorm keeps only its input and the fp32 reciprocal
RMS; SwiGLU keeps gate and up and recomputes the SiLU in backward; attention keeps q, k, v, its
output and the log-sum-exp (the flash kernels keep no s-by-s matrix). The q/k norms keep
their input, which is a view of the fused q/k/v projection's output (so that whole output
stays), and their fp32 reciprocal RMS; the biases keep nothing (their gradient is the output
gradient summed over tokens). The post-norms keep their input and reciprocal RMS as the
others do; GeGLU keeps what SwiGLU keeps.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterable
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
from ctxlaunch.perf.memory import LOSS_CHUNK_TOKENS
from ctxlaunch.runtime.modeling.loss import chunked_cross_entropy
from ctxlaunch.runtime.modeling.moe import MoEFeedForward, Routing
from ctxlaunch.runtime.modeling.pointwise import GATED, RMSNorm, _pointwise, _SwiGLU
from ctxlaunch.runtime.modeling.tiling import tiled_feed_forward

AttentionFn = Callable[..., torch.Tensor]
"""attend(q, k, v, **options) -> out; the options, each given only when the layer has it:
documents (a document mask), window (a local layer's), scale, softcap, sinks."""
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
        o_bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
        norm_offset: bool = False,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = head_dim or hidden // heads
        self.wqkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=o_bias)
        # One gain of head_dim for every head (the q/k norms): under TP each rank applies it to its own
        # heads, and under Ulysses before the all-to-all, while every head is still local.
        self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, eps, norm_offset) if qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, eps, norm_offset) if qk_norm else None
        self.window = window
        """A local layer's sliding window (None: a full layer)."""
        self.scale = scale
        """What scores are multiplied by (None: the kernels' 1/sqrt(head_dim))."""
        self.softcap = softcap
        """Scores soft-capped, softcap * tanh(score / softcap) (None: not)."""
        # One sink logit per query head, split with the heads under TP.
        self.sinks: nn.Parameter | None = nn.Parameter(torch.zeros(heads)) if sinks else None
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
        out = self.attend(q, k, v, **self.options(documents)).transpose(1, 2)
        out = out.reshape(b, s, self.heads * d)
        if self.wo.bias is None or self.exit is _identity:
            # Through the module: DeepSpeed ZeRO-3 gathers a weight in its module's hooks.
            return self.exit(self.wo(out))
        # Under TP the bias after `exit`: once, not on each rank before the reduce sums them
        # (DeepSpeed, which needs the module's hooks, runs at TP 1 only).
        return self.exit(F.linear(out, self.wo.weight)) + self.wo.bias

    def options(self, documents: Documents) -> dict[str, Any]:
        """What `attend` is told beside q, k and v: only what this layer has, so a layer of
        the common block calls attend(q, k, v) as it always did."""
        given = {
            "documents": documents,
            "window": self.window,
            "scale": self.scale,
            "softcap": self.softcap,
            "sinks": self.sinks,
        }
        return {name: value for name, value in given.items() if value is not None}


def _draw(key: str, shape: torch.Size | tuple[int, ...], std: float) -> torch.Tensor:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(shape, generator=generator) * std


def _moe_feed_forward(
    hidden: int,
    moe: ExpertsShape | None,
    shared_expert: bool,
    layer: int,
    *,
    biases: bool = False,
    top_k_first: bool = False,
) -> MoEFeedForward | None:
    """Block `layer`'s mixture-of-experts feed-forward, where `moe` makes it one (`biases`:
    on the router and the experts; `top_k_first`: the router's softmax over its top-k)."""
    if moe is None or not moe.is_moe_layer(layer):
        return None
    shared = (
        FeedForward(hidden, moe.shared_ffn_hidden)
        if shared_expert and moe.shared_ffn_hidden
        else None
    )
    return MoEFeedForward(
        hidden,
        moe,
        renormalise=moe.norm_topk_prob,
        swiglu=_SwiGLU.apply,
        shared=shared,
        biases=biases,
        top_k_first=top_k_first,
    )


def _local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor:
    from ctxlaunch.cp import full_attention

    return full_attention(q, k, v, causal=True, **options)


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, activation: str = "silu"):
        super().__init__()
        self.ffn_hidden = ffn_hidden
        self.w_gate_up = nn.Linear(hidden, 2 * ffn_hidden, bias=False)
        self.w_down = nn.Linear(ffn_hidden, hidden, bias=False)
        self.gated = GATED[activation]
        self.project_in: ProjectIn = _project
        self.exit: Hook = _identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_in(x, self.w_gate_up).chunk(2, dim=-1)
        return self.exit(self.w_down(self.gated.apply(gate, up)))


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
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_offset: bool = False,
        post_norms: bool = False,
        activation: str = "silu",
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        ffn: nn.Module | None = None,
    ):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps, norm_offset)
        self.attn = Attention(
            hidden,
            heads,
            kv_heads,
            head_dim,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            eps=eps,
            norm_offset=norm_offset,
            window=window,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
        )
        # Norms on each sub-block's output, before the residual add (None: not this family's).
        self.attn_post_norm = RMSNorm(hidden, eps, norm_offset) if post_norms else None
        self.ffn_norm = RMSNorm(hidden, eps, norm_offset)
        # A mixture of experts where the model says (moe.MoEFeedForward), else the dense MLP.
        self.ffn: nn.Module = (
            ffn if ffn is not None else FeedForward(hidden, ffn_hidden, activation)
        )
        self.ffn_post_norm = RMSNorm(hidden, eps, norm_offset) if post_norms else None
        self.checkpointing: Checkpointing = "none"
        self.mlp_tile_tokens: int | None = None
        """The feed-forward half over tiles of this many tokens (tiling.py); None: whole."""
        self.offload_input: Callable[[torch.Tensor], AbstractContextManager[None]] = _keep_input
        """Around the full checkpoint, given the block's input: where the input it saves is
        kept (on the device; `parallelize` installs offload.py's host-memory offload)."""

    def _feed_forward_tile(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ffn(self.ffn_norm(x))
        return self.ffn_post_norm(y) if self.ffn_post_norm is not None else y

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp_tile_tokens:
            params = [*self.ffn_norm.parameters(), *self.ffn.parameters()]
            if self.ffn_post_norm is not None:
                params += list(self.ffn_post_norm.parameters())
            return x + tiled_feed_forward(self._feed_forward_tile, x, self.mlp_tile_tokens, params)
        return x + self._feed_forward_tile(x)

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents = None
    ) -> torch.Tensor:
        attended = self.attn(self.attn_norm(x), cos, sin, documents)
        if self.attn_post_norm is not None:
            attended = self.attn_post_norm(attended)
        x = x + attended
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
        norm_offset: bool = False,
        post_norms: bool = False,
        activation: str = "silu",
        embedding_scale: bool = False,
        attention_sinks: bool = False,
        layer_windows: tuple[int | None, ...] | None = None,
        local_rope_theta: float | None = None,
        query_pre_attn_scalar: float | None = None,
        attention_softcap: float | None = None,
        logit_softcap: float | None = None,
        moe: ExpertsShape | None = None,
        shared_expert: bool = False,
        o_bias: bool = False,
        expert_biases: bool = False,
        router_top_k_first: bool = False,
    ):
        super().__init__()
        self.hidden = hidden
        self.head_dim = head_dim or hidden // heads
        self.rope_theta = rope_theta
        self.rope_scaling: RopeScaling = rope_scaling or DefaultRope()
        self.local_rope_theta = local_rope_theta
        """The local layers' RoPE base, unscaled (None: they rotate as the full ones)."""
        self.norm_offset = norm_offset
        self.embedding_scale = embedding_scale
        """The embedding's output is multiplied by sqrt(hidden), rounded to its dtype."""
        self.logit_softcap = logit_softcap
        """The output logits are soft-capped before the loss (None: not)."""
        windows = layer_windows or (None,) * layers
        # None keeps the kernels' own 1/sqrt(head_dim), bit for bit what they always computed.
        scale = None if query_pre_attn_scalar is None else query_pre_attn_scalar**-0.5
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
                o_bias=o_bias,
                qk_norm=qk_norm,
                norm_offset=norm_offset,
                post_norms=post_norms,
                activation=activation,
                window=windows[i],
                scale=scale,
                softcap=attention_softcap,
                sinks=attention_sinks,
                ffn=_moe_feed_forward(
                    hidden,
                    moe,
                    shared_expert,
                    i,
                    biases=expert_biases,
                    top_k_first=router_top_k_first,
                ),
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
        self.norm: RMSNorm | None = RMSNorm(hidden, norm_eps, norm_offset)
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
            norm_offset=model.norm_offset,
            post_norms=model.post_norms,
            activation=model.activation,
            embedding_scale=model.embedding_scale,
            attention_sinks=model.attention_sinks,
            layer_windows=model.layer_windows,
            local_rope_theta=model.local_rope_theta,
            query_pre_attn_scalar=model.query_pre_attn_scalar,
            attention_softcap=model.attention_softcap,
            logit_softcap=model.logit_softcap,
            moe=model.moe,
            shared_expert=model.shared_expert,
            o_bias=model.o_bias,
            expert_biases=model.expert_biases,
            router_top_k_first=model.router_top_k_first,
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
            # A gain of 1 either way: stored as 1, or as 0 where it is applied as 1 + w.
            return torch.zeros(shape) if self.norm_offset else torch.ones(shape)
        if name.endswith((".bias", ".sinks", "experts.b_gate_up", "experts.b_down")):
            count = experts[1] if experts is not None and ".experts." in name else shape[0]
            return torch.zeros((count, *shape[1:]))
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
        # Tables in the dtype q and k will have (autocast's, if on), made once for all blocks
        # of a kind: the full layers', and the local layers' where their RoPE base differs.
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        blocks = list(blocks)
        full = rope_tables(positions, self.head_dim, self.rope_theta, dtype, self.rope_scaling)
        local = full
        if self.local_rope_theta is not None and any(b.attn.window for b in blocks):
            local = rope_tables(positions, self.head_dim, self.local_rope_theta, dtype)
        for block in blocks:
            cos, sin = local if block.attn.window is not None else full
            x = block(x, cos, sin, documents)
        return x

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding of `tokens` (this stage must hold it), scaled where the family
        scales it: by sqrt(hidden) rounded to the embedding's dtype, as transformers does, a
        plain number so that nothing is saved for backward."""
        if self.embed is None:
            raise RuntimeError("this pipeline rank holds no embedding")
        x = self.embed(tokens)
        if self.embedding_scale:
            x = x * float(torch.tensor(self.hidden**0.5, dtype=x.dtype))
        return x

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits soft-capped where the spec says (transformers' order: divide, tanh,
        multiply)."""
        if self.logit_softcap is None:
            return logits
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor, documents: Documents = None
    ) -> torch.Tensor:
        """The final (normed) hidden states of the whole model (no pipeline split)."""
        if self.embed is None or self.norm is None:
            raise RuntimeError(
                "hidden_states needs the whole model; this one is a pipeline rank's part"
            )
        return self.norm(
            self.run_blocks(self.embed_tokens(tokens), positions, self.block_modules(), documents)
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
            logits = self.cap_logits(F.linear(hidden[start:end], self._output_weight()).float())
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
            softcap=self.logit_softcap,
        )
