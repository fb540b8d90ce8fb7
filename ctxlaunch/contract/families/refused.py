"""Families transformers knows and ctxlaunch refuses, by config.json's model_type, with what
their block has that ctxlaunch's does not: what `model.init_from` says when it refuses one."""

from __future__ import annotations

REFUSED: dict[str, str] = {
    "gemma": "a GeGLU feed-forward (gelu_pytorch_tanh), an embedding scaled by sqrt(hidden) and "
    "RMSNorm gains applied as 1 + w",
    "deepseek_v2": "multi-head latent attention (compressed K/V) and a router choosing top-k "
    "groups of experts",
    "deepseek_v3": "multi-head latent attention (compressed K/V), a sigmoid router with a "
    "per-expert bias choosing top-k groups of experts, and multi-token prediction layers",
    "olmoe": "RMSNorms over the whole q and k projections (not per head), which ctxlaunch's "
    "mixture-of-experts block lacks",
    "llama4": "chunked local attention layers without RoPE beside global ones, and a "
    "sigmoid router with a shared expert",
    "llama4_text": "chunked local attention layers without RoPE beside global ones, and a "
    "sigmoid router with a shared expert",
    "phi3": "fused qkv_proj and gate_up_proj weights and, in the long-context releases, LongRoPE",
    "olmo2": "RMSNorms over the whole q and k projections and norms after each sub-block",
    "cohere": "LayerNorm instead of RMSNorm, parallel attention and feed-forward, and "
    "interleaved RoPE",
    "gpt_neox": "LayerNorm, a GELU feed-forward, parallel residuals and partial RoPE",
    "falcon": "LayerNorm, a GELU feed-forward and parallel attention",
    "starcoder2": "LayerNorm, a GELU feed-forward and biases on every projection",
    "phi": "LayerNorm, a GELU feed-forward and partial RoPE",
    "qwen3_next": "gated DeltaNet linear-attention layers and gated attention",
}
"""Families transformers knows and ctxlaunch refuses, by model_type: what the block has that
ctxlaunch's does not."""
