"""Qwen3 dense: the common block with an RMSNorm over each head of q and of k before RoPE, a
head width free of hidden / heads, no biases, and the layered sliding window."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxlaunch.contract.families.family import (
    Family,
    WindowedShape,
    layered_types,
    layered_window,
    layered_window_keys,
)


class Qwen3(Family):
    """The window is on when `use_sliding_window` says so, on the layers it names; the
    projections carry no bias."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        return layered_window(config)

    def layer_types(self, config: Mapping[str, Any]) -> tuple[str, ...] | None:
        return layered_types(config)

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": False, **layered_window_keys(model, base)}


FAMILY = Qwen3(
    name="qwen3",
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    releases="Qwen3 dense",
    qk_norm=True,
    presets={
        # Qwen3-8B (config.json of Qwen/Qwen3-8B: q/k norms, head_dim 128, no biases).
        "qwen3-8b": dict(
            layers=36,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            ffn_hidden=12288,
            vocab=151936,
            rope_theta=1000000.0,
            norm_eps=1e-6,
            tie_embeddings=False,
        ),
        # A CPU-sized shape of the family for the tests.
        "tiny-qwen3": dict(
            layers=2,
            hidden=128,
            heads=4,
            kv_heads=2,
            head_dim=64,
            ffn_hidden=384,
            vocab=256,
            rope_theta=1000000.0,
            norm_eps=1e-6,
            tie_embeddings=False,
        ),
    },
)
