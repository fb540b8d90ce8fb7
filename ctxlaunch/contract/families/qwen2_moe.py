"""Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (biases on q, k and v) with a mixture-of-experts
feed-forward: a softmax router, top-k, renormalised where `norm_topk_prob` says (the released
checkpoints do not), and a shared expert every token passes through, its output scaled by a
sigmoid gate of the token; the layers `decoder_sparse_step` and `mlp_only_layers` leave out stay
dense."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxlaunch.contract.families.experts import (
    ExpertNames,
    moe_config_fields,
    moe_export_keys,
)
from ctxlaunch.contract.families.family import (
    Family,
    WindowedShape,
    layered_window,
    layered_window_keys,
)


class Qwen2Moe(Family):
    """The window as Qwen2's; the experts' keys as transformers' Qwen2MoeConfig names them."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        return layered_window(config)

    def moe_fields(self, config: Mapping[str, Any], where: str) -> dict[str, Any] | None:
        return moe_config_fields(
            config,
            where,
            expert_width_key="moe_intermediate_size",
            shared_width_key="shared_expert_intermediate_size",
            renormalises=False,
        )

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        keys = layered_window_keys(model, base)
        moe = model.moe
        if moe is not None:
            keys |= moe_export_keys(
                moe, expert_width_key="moe_intermediate_size", sparse_layer_keys=True
            )
            keys |= {
                "num_experts": moe.experts,
                "shared_expert_intermediate_size": moe.shared_ffn_hidden,
                "norm_topk_prob": moe.norm_topk_prob,
                "router_aux_loss_coef": moe.aux_loss_coef,
            }
        return keys


_QWEN2_MOE = dict(vocab=151936, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False)

FAMILY = Qwen2Moe(
    name="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    releases="Qwen1.5-MoE, Qwen2-MoE",
    qkv_bias=True,
    experts=ExpertNames(),
    shared_expert=True,
    presets={
        # Qwen1.5-MoE-A2.7B (config.json of Qwen/Qwen1.5-MoE-A2.7B: 60 experts of 1,408, top-4,
        # a shared expert of 5,632) and Qwen2-57B-A14B (64 experts of 2,560, top-8, a shared
        # expert of 20,480).
        "qwen1.5-moe-a2.7b": dict(
            layers=24,
            hidden=2048,
            heads=16,
            kv_heads=16,
            ffn_hidden=5632,
            moe=dict(experts=60, experts_per_token=4, ffn_hidden=1408, shared_ffn_hidden=5632),
            **_QWEN2_MOE,
        ),
        "qwen2-57b-a14b": dict(
            layers=28,
            hidden=3584,
            heads=28,
            kv_heads=4,
            ffn_hidden=18944,
            moe=dict(experts=64, experts_per_token=8, ffn_hidden=2560, shared_ffn_hidden=20480),
            **_QWEN2_MOE,
        ),
    },
)
