"""Families transformers knows and ctxlaunch refuses, by config.json's model_type, with what
their block has that ctxlaunch's does not: what `model.init_from` says when it refuses one."""

from __future__ import annotations

_MOE = "a mixture-of-experts feed-forward (ctxlaunch's models are dense)"
REFUSED: dict[str, str] = {
    "gemma": "a GeGLU feed-forward (gelu_pytorch_tanh), an embedding scaled by sqrt(hidden) and "
    "RMSNorm gains applied as 1 + w",
    "mixtral": _MOE,
    "qwen2_moe": _MOE,
    "qwen3_moe": _MOE,
    "deepseek_v2": "multi-head latent attention (compressed K/V) and " + _MOE,
    "deepseek_v3": "multi-head latent attention (compressed K/V) and " + _MOE,
    "phi3": "fused qkv_proj and gate_up_proj weights and, in the long-context releases, LongRoPE",
    "olmo2": "RMSNorms over the whole q and k projections and norms after each sub-block",
    "cohere": "LayerNorm instead of RMSNorm, parallel attention and feed-forward, and "
    "interleaved RoPE",
    "gpt_neox": "LayerNorm, a GELU feed-forward, parallel residuals and partial RoPE",
    "falcon": "LayerNorm, a GELU feed-forward and parallel attention",
    "starcoder2": "LayerNorm, a GELU feed-forward and biases on every projection",
    "phi": "LayerNorm, a GELU feed-forward and partial RoPE",
    "qwen3_next": "gated DeltaNet linear-attention layers and " + _MOE,
}
"""Families transformers knows and ctxlaunch refuses, by model_type: what the block has that
ctxlaunch's does not."""
