"""Mistral 7B and Mistral NeMo: the common block with a head width free of hidden / heads and a
sliding window on every layer (4,096 in v0.1, which ctxlaunch trains as local layers; null
since v0.2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxlaunch.contract.families.family import Family, WindowedShape

_MISTRAL = dict(kv_heads=8, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False)


class Mistral(Family):
    """config.json's `sliding_window` applies to every layer."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        window = config.get("sliding_window")
        return int(window) if window else None

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        return {"sliding_window": model.sliding_window}


FAMILY = Mistral(
    name="mistral",
    architecture="MistralForCausalLM",
    model_type="mistral",
    releases="Mistral 7B (v0.1 with its window), Mistral NeMo",
    presets={
        # Mistral 7B v0.3 (config.json of mistralai/Mistral-7B-v0.3: no sliding window since
        # v0.2) and Mistral NeMo 12B (head_dim 128 with hidden 5,120 and 32 heads).
        "mistral-7b": dict(
            layers=32, hidden=4096, heads=32, ffn_hidden=14336, vocab=32768, **_MISTRAL
        ),
        # Mistral 7B v0.1 (config.json of mistralai/Mistral-7B-v0.1: a 4,096-token window on
        # every layer, RoPE base 10,000, a 32,000-token vocabulary).
        "mistral-7b-v0.1": dict(
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            ffn_hidden=14336,
            vocab=32000,
            rope_theta=10000.0,
            norm_eps=1e-5,
            tie_embeddings=False,
            sliding_window=4096,
        ),
        "mistral-nemo-12b": dict(
            layers=40,
            hidden=5120,
            heads=32,
            head_dim=128,
            ffn_hidden=14336,
            vocab=131072,
            **_MISTRAL,
        ),
    },
)
