"""Qwen2, Qwen2.5 and Qwen2.5-1M: the common block with biases on the q, k and v projections
(none on o), and a sliding window on the layers `use_sliding_window` and `max_window_layers`
(or `layer_types`) name, which the released checkpoints leave off."""

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

_QWEN25_7B = dict(layers=28, hidden=3584, heads=28, kv_heads=4, ffn_hidden=18944, vocab=152064)


class Qwen2(Family):
    """The window is on when `use_sliding_window` says so, on the layers it names."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        return layered_window(config)

    def layer_types(self, config: Mapping[str, Any]) -> tuple[str, ...] | None:
        return layered_types(config)

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        return layered_window_keys(model, base)


FAMILY = Qwen2(
    name="qwen2",
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    releases="Qwen2, Qwen2.5, Qwen2.5-1M",
    qkv_bias=True,
    presets={
        # Qwen2.5-7B and Qwen2.5-7B-Instruct-1M (config.json of Qwen/Qwen2.5-7B and
        # Qwen/Qwen2.5-7B-Instruct-1M: the 1M model's RoPE base 1e7, use_sliding_window false
        # in both).
        "qwen2.5-7b": dict(**_QWEN25_7B, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False),
        "qwen2.5-7b-1m": dict(
            **_QWEN25_7B, rope_theta=10000000.0, norm_eps=1e-5, tie_embeddings=False
        ),
    },
)
