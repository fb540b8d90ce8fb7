"""Mixtral: the common block (Mistral's attention, a window on every layer, null in the released
checkpoints) with a mixture-of-experts feed-forward on every layer: a softmax router, top-k,
always renormalised; each expert as wide as config.json's intermediate_size; no shared
expert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxlaunch.contract.families.experts import (
    ExpertNames,
    moe_config_fields,
    moe_export_keys,
)
from ctxlaunch.contract.families.family import BlockShape, Family, WindowedShape

_MIXTRAL = dict(kv_heads=8, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False)


class Mixtral(Family):
    """config.json's `sliding_window` applies to every layer; every layer is sparse and each
    expert is intermediate_size wide."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        window = config.get("sliding_window")
        return int(window) if window else None

    def moe_fields(self, config: Mapping[str, Any], where: str) -> dict[str, Any] | None:
        return moe_config_fields(
            config,
            where,
            expert_width_key="intermediate_size",
            shared_width_key=None,
            renormalises=True,
        )

    def moe_problem(self, model: BlockShape) -> str | None:
        moe = model.moe
        if moe is None:
            return None
        if moe.layer_step != 1 or moe.dense_layers:
            return "every Mixtral layer is a mixture of experts: layer_step 1, no dense_layers"
        if moe.ffn_hidden != model.ffn_hidden:
            return (
                f"Mixtral's experts are intermediate_size wide: moe.ffn_hidden = "
                f"{moe.ffn_hidden} must equal model.ffn_hidden = {model.ffn_hidden}"
            )
        return None

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        keys: dict[str, Any] = {"sliding_window": model.sliding_window}
        moe = model.moe
        if moe is not None:
            keys |= moe_export_keys(
                moe, expert_width_key="intermediate_size", sparse_layer_keys=False
            )
            keys |= {
                "num_local_experts": moe.experts,
                "router_aux_loss_coef": moe.aux_loss_coef,
                "router_jitter_noise": 0.0,
            }
        return keys


_8X7B = dict(layers=32, hidden=4096, heads=32, ffn_hidden=14336, vocab=32000)
_8X22B = dict(layers=56, hidden=6144, heads=48, ffn_hidden=16384, vocab=32768)

FAMILY = Mixtral(
    name="mixtral",
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    releases="Mixtral 8x7B, 8x22B",
    experts=ExpertNames(
        router="block_sparse_moe.gate.weight",
        gate="block_sparse_moe.experts.{j}.w1.weight",
        up="block_sparse_moe.experts.{j}.w3.weight",
        down="block_sparse_moe.experts.{j}.w2.weight",
    ),
    router_renormalises=True,
    presets={
        # Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 (config.json of mistralai/: 8 experts,
        # top-2, router_aux_loss_coef 0.02 in 8x7B's, sliding_window null).
        "mixtral-8x7b": dict(
            **_8X7B,
            moe=dict(
                experts=8,
                experts_per_token=2,
                ffn_hidden=14336,
                norm_topk_prob=True,
                aux_loss_coef=0.02,
            ),
            **_MIXTRAL,
        ),
        "mixtral-8x22b": dict(
            **_8X22B,
            moe=dict(
                experts=8,
                experts_per_token=2,
                ffn_hidden=16384,
                norm_topk_prob=True,
                aux_loss_coef=0.001,
            ),
            **_MIXTRAL,
        ),
    },
)
