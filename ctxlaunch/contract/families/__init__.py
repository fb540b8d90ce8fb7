"""The decoder families ctxlaunch trains, and the ones transformers knows that it refuses.

Every family here is the same block (RMSNorm, RoPE, grouped-query attention, SwiGLU) with at
most these differences, which the model section records and every part of ctxlaunch reads
from it (the trainer's model, TP, Ulysses, the planner, export):

    family   Hugging Face class   what it adds to the Llama block
    llama    LlamaForCausalLM     (none; head_dim may differ from hidden / heads)
    mistral  MistralForCausalLM   head_dim free of hidden / heads (Mistral NeMo), a sliding
                                  window (null since v0.2; v0.1 set 4,096)
    qwen2    Qwen2ForCausalLM     biases on the q, k and v projections (none on o); a sliding
                                  window that the released checkpoints leave off
    qwen3    Qwen3ForCausalLM     an RMSNorm over each head of q and of k before RoPE; head_dim
                                  free of hidden / heads

A sliding window is not implemented: a window shorter than the job's sequence (which would
change which keys a query sees) is refused by the spec's rules; one at least as long as the
sequence masks nothing, so the block is exactly the full causal one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FamilyName = Literal["llama", "mistral", "qwen2", "qwen3"]


@dataclass(frozen=True)
class Family:
    """One decoder family: its Hugging Face names and what its block adds to Llama's."""

    name: FamilyName
    architecture: str
    """The transformers class of its checkpoints (config.json's `architectures`)."""
    model_type: str
    """config.json's `model_type`."""
    qkv_bias: bool
    """Biases on the q, k and v projections (none on o)."""
    qk_norm: bool
    """An RMSNorm (weight of head_dim) over each head of q and of k, before RoPE."""
    releases: str
    """The released models of the family, for messages and docs."""


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", "llama", False, False, "Llama 2, 3, 3.1, 3.2"),
    "mistral": Family(
        "mistral", "MistralForCausalLM", "mistral", False, False, "Mistral 7B, Mistral NeMo"
    ),
    "qwen2": Family(
        "qwen2", "Qwen2ForCausalLM", "qwen2", True, False, "Qwen2, Qwen2.5, Qwen2.5-1M"
    ),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "qwen3", False, True, "Qwen3 dense"),
}
"""The families `model.family` takes, by name."""

_MOE = "a mixture-of-experts feed-forward (ctxlaunch's models are dense)"
UNSUPPORTED: dict[str, str] = {
    "gemma": "a GeGLU feed-forward (gelu_pytorch_tanh), an embedding scaled by sqrt(hidden) and "
    "RMSNorm gains applied as 1 + w",
    "gemma2": "a GeGLU feed-forward, norms after each sub-block, logit soft-capping and "
    "alternating sliding-window layers",
    "gemma3": "a GeGLU feed-forward, norms after each sub-block, q/k norms with 1 + w gains and "
    "interleaved local (sliding-window) layers with their own RoPE base",
    "gemma3_text": "a GeGLU feed-forward, norms after each sub-block, q/k norms with 1 + w gains "
    "and interleaved local (sliding-window) layers with their own RoPE base",
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


def family_of_architecture(architecture: str) -> Family | None:
    """The family whose checkpoints are of transformers class `architecture`, if any."""
    return next((f for f in FAMILIES.values() if f.architecture == architecture), None)


def family_of_model_type(model_type: str) -> Family | None:
    """The family whose config.json has `model_type`, if any."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


def supported_architectures() -> str:
    """The classes `model.init_from` takes, for messages."""
    return ", ".join(f"{f.architecture} ({f.releases})" for f in FAMILIES.values())
