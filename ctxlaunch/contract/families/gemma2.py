"""Gemma 2: the common block with RMSNorm gains applied as 1 + w, a norm after each sub-block
as well as before it, a GeGLU feed-forward (GELU's tanh approximation), the embedding scaled by
sqrt(hidden), tied embeddings, attention scores scaled by query_pre_attn_scalar^-1/2 and
soft-capped, final logits soft-capped, and local (sliding-window) layers alternating with
full ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxlaunch.contract.families.family import (
    Family,
    WindowedShape,
    hf_layer_types,
    read_layer_types,
)

GEMMA_DEFAULTS: dict[str, Any] = {
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
    "head_dim": 256,
    "num_key_value_heads": 4,
}
"""What transformers' Gemma config classes assume of a key config.json leaves out (their
defaults), common to Gemma 2 and Gemma 3."""


def refuse_bidirectional(config: Mapping[str, Any]) -> None:
    """A ValueError for a checkpoint whose text attends both ways (an encoder's use)."""
    if config.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention is true: ctxlaunch trains causal decoders only"
        )


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def gemma_export_keys(model: WindowedShape) -> dict[str, Any]:
    """The config.json keys both Gemma generations read, as the model was trained."""
    return {
        "attention_bias": False,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        # transformers' strict config takes an int here (every released value is one).
        "query_pre_attn_scalar": _whole(model.query_pre_attn_scalar or model.head_dim),
        "sliding_window": model.sliding_window,
        "layer_types": hf_layer_types(model),
        "final_logit_softcapping": model.logit_softcap,
        "use_bidirectional_attention": False,
    }


class Gemma2(Family):
    """Every other layer local, unless config.json lists the layers' kinds."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        window = config.get("sliding_window")
        return int(window) if window else None

    def layer_types(self, config: Mapping[str, Any]) -> tuple[str, ...] | None:
        if not config.get("sliding_window"):
            return None
        return read_layer_types(config) or ("local", "full")

    def config_fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        refuse_bidirectional(config)
        return {
            "query_pre_attn_scalar": config.get("query_pre_attn_scalar"),
            "attention_softcap": config.get("attn_logit_softcapping"),
            "logit_softcap": config.get("final_logit_softcapping"),
        }

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        return {**gemma_export_keys(model), "attn_logit_softcapping": model.attention_softcap}


_GEMMA2 = dict(
    vocab=256000,
    rope_theta=10000.0,
    norm_eps=1e-6,
    tie_embeddings=True,
    sliding_window=4096,
    layer_types=("local", "full"),
    attention_softcap=50.0,
    logit_softcap=30.0,
)

FAMILY = Gemma2(
    name="gemma2",
    architecture="Gemma2ForCausalLM",
    model_type="gemma2",
    releases="Gemma 2",
    norm_offset=True,
    post_norms=True,
    activation="gelu_tanh",
    embedding_scale=True,
    config_defaults={
        **GEMMA_DEFAULTS,
        "rope_theta": 10000.0,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    presets={
        # Gemma 2 9B and 27B (config.json of google/gemma-2-9b and google/gemma-2-27b: the 27B
        # scales scores by (hidden / heads)^-1/2 = 144^-1/2, not head_dim's).
        "gemma-2-9b": dict(
            layers=42,
            hidden=3584,
            heads=16,
            kv_heads=8,
            head_dim=256,
            ffn_hidden=14336,
            query_pre_attn_scalar=256,
            **_GEMMA2,
        ),
        "gemma-2-27b": dict(
            layers=46,
            hidden=4608,
            heads=32,
            kv_heads=16,
            head_dim=128,
            ffn_hidden=36864,
            query_pre_attn_scalar=144,
            **_GEMMA2,
        ),
    },
)
