"""Gemma 3 (its text model: Gemma3ForCausalLM, and the language model inside a multimodal
Gemma 3 checkpoint): Gemma 2's block with q/k norms (gains applied as 1 + w) instead of score
soft-capping, five local (sliding-window) layers to one full, and a RoPE base per kind: the
local layers at 10,000 unscaled, the full ones at 1e6 with linear scaling in 4B and up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxlaunch.contract.families.family import Family, WindowedShape, read_layer_types
from ctxlaunch.contract.families.gemma2 import (
    GEMMA_DEFAULTS,
    gemma_export_keys,
    refuse_bidirectional,
)

FULL, SLIDING = "full_attention", "sliding_attention"
"""transformers' keys of the two kinds' RoPE sections (`rope_parameters`, 5.x)."""


def _rope_sections(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """(full layers' RoPE section, local layers' one) of transformers 5's per-kind
    `rope_parameters`; (None, None) in 4.x's spelling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        return params.get(FULL), params.get(SLIDING)
    return None, None


class Gemma3(Family):
    """Local layers by `layer_types` or every `sliding_window_pattern`-th layer full; the local
    layers' RoPE base from `rope_local_base_freq` (4.x) or `rope_parameters` (5.x)."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        window = config.get("sliding_window")
        return int(window) if window else None

    def layer_types(self, config: Mapping[str, Any]) -> tuple[str, ...] | None:
        if not config.get("sliding_window"):
            return None
        kinds = read_layer_types(config)
        if kinds is not None:
            return kinds
        pattern = int(config.get("sliding_window_pattern") or 6)
        return tuple("local" if (i + 1) % pattern else "full" for i in range(pattern))

    def rope_parameters(self, config: Mapping[str, Any]) -> Any:
        full, _ = _rope_sections(config)
        if full is not None:
            return full
        return config.get("rope_scaling") or {}

    def config_fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        refuse_bidirectional(config)
        _, local = _rope_sections(config)
        if local is not None:
            if local.get("rope_type", local.get("type", "default")) != "default":
                raise ValueError(
                    f"rope_parameters.{SLIDING} {local!r}: the local layers' RoPE must be "
                    "unscaled (ctxlaunch scales the full layers' only)"
                )
            local_theta = local.get("rope_theta", 10000.0)
        else:
            local_theta = config.get("rope_local_base_freq", 10000.0)
        # transformers' Gemma 3 ignores attn_logit_softcapping: its scores are not capped.
        return {
            "query_pre_attn_scalar": config.get("query_pre_attn_scalar"),
            "logit_softcap": config.get("final_logit_softcapping"),
            "local_rope_theta": float(local_theta),
        }

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        return {
            **gemma_export_keys(model),
            "rope_local_base_freq": model.local_rope_theta or model.rope_theta,
        }


_GEMMA3 = dict(
    vocab=262208,
    rope_theta=1000000.0,
    rope_scaling={"type": "linear", "factor": 8.0},
    local_rope_theta=10000.0,
    norm_eps=1e-6,
    tie_embeddings=True,
    sliding_window=1024,
    layer_types=("local", "local", "local", "local", "local", "full"),
)

FAMILY = Gemma3(
    name="gemma3",
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    releases="Gemma 3 (text, and the language model of the multimodal checkpoints)",
    qk_norm=True,
    norm_offset=True,
    post_norms=True,
    activation="gelu_tanh",
    embedding_scale=True,
    config_defaults={
        **GEMMA_DEFAULTS,
        "rope_theta": 1000000.0,
        "final_logit_softcapping": None,
    },
    wrappers={"Gemma3ForConditionalGeneration": "gemma3"},
    # transformers 4.x and the released files: language_model.model.*; 5.x's own
    # Gemma3Model: model.language_model.*.
    wrapped_prefixes=("language_model.model.", "model.language_model."),
    presets={
        # Gemma 3 4B, 12B and 27B (text_config of google/gemma-3-4b-pt, -12b-pt, -27b-pt: the
        # 27B scales scores by (hidden / heads)^-1/2 = 168^-1/2 with head_dim 128).
        "gemma-3-4b": dict(
            layers=34,
            hidden=2560,
            heads=8,
            kv_heads=4,
            head_dim=256,
            ffn_hidden=10240,
            query_pre_attn_scalar=256,
            **_GEMMA3,
        ),
        "gemma-3-12b": dict(
            layers=48,
            hidden=3840,
            heads=16,
            kv_heads=8,
            head_dim=256,
            ffn_hidden=15360,
            query_pre_attn_scalar=256,
            **_GEMMA3,
        ),
        "gemma-3-27b": dict(
            layers=62,
            hidden=5376,
            heads=32,
            kv_heads=16,
            head_dim=128,
            ffn_hidden=21504,
            query_pre_attn_scalar=168,
            **_GEMMA3,
        ),
        # A CPU-sized shape of the family for the tests and the local demo.
        "tiny-gemma3": dict(
            layers=6,
            hidden=128,
            heads=4,
            kv_heads=2,
            head_dim=32,
            ffn_hidden=256,
            vocab=256,
            rope_theta=1000000.0,
            local_rope_theta=10000.0,
            norm_eps=1e-6,
            tie_embeddings=True,
            sliding_window=64,
            layer_types=("local", "local", "full"),
            query_pre_attn_scalar=32,
        ),
    },
)
