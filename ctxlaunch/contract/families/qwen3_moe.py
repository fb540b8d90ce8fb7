"""Qwen3-MoE: Qwen3's attention (an RMSNorm over each head of q and of k, a head width free of
hidden / heads, no biases) with a mixture-of-experts feed-forward: a softmax router over the
experts, top-k, renormalised where `norm_topk_prob` says, no shared expert; the layers
`decoder_sparse_step` and `mlp_only_layers` leave out stay dense."""

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

_QWEN3_MOE = dict(vocab=151936, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False)


class Qwen3Moe(Family):
    """The window as Qwen3's; the experts' keys as transformers' Qwen3MoeConfig names them."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        return layered_window(config)

    def moe_fields(self, config: Mapping[str, Any], where: str) -> dict[str, Any] | None:
        return moe_config_fields(
            config,
            where,
            expert_width_key="moe_intermediate_size",
            shared_width_key=None,
            renormalises=False,
        )

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        keys = {"attention_bias": False, **layered_window_keys(model, base)}
        moe = model.moe
        if moe is not None:
            keys |= moe_export_keys(
                moe, expert_width_key="moe_intermediate_size", sparse_layer_keys=True
            )
            keys |= {
                "num_experts": moe.experts,
                "norm_topk_prob": moe.norm_topk_prob,
                "router_aux_loss_coef": moe.aux_loss_coef,
            }
        return keys


FAMILY = Qwen3Moe(
    name="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    releases="Qwen3-MoE (30B-A3B, 235B-A22B)",
    qk_norm=True,
    experts=ExpertNames(),
    presets={
        # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B: 128 experts of 768, top-8,
        # norm_topk_prob true, every layer sparse, head_dim 128 with 32 query and 4 K/V heads).
        "qwen3-30b-a3b": dict(
            layers=48,
            hidden=2048,
            heads=32,
            kv_heads=4,
            head_dim=128,
            ffn_hidden=6144,
            moe=dict(experts=128, experts_per_token=8, ffn_hidden=768, norm_topk_prob=True),
            **_QWEN3_MOE,
        ),
        # Qwen3-235B-A22B (config.json of Qwen/Qwen3-235B-A22B: 128 experts of 1,536, top-8).
        "qwen3-235b-a22b": dict(
            layers=94,
            hidden=4096,
            heads=64,
            kv_heads=4,
            head_dim=128,
            ffn_hidden=12288,
            moe=dict(experts=128, experts_per_token=8, ffn_hidden=1536, norm_topk_prob=True),
            **_QWEN3_MOE,
        ),
        # A CPU-sized shape of the family for the demo and the tests.
        "tiny-qwen3-moe": dict(
            layers=2,
            hidden=128,
            heads=4,
            kv_heads=2,
            head_dim=32,
            ffn_hidden=256,
            vocab=256,
            rope_theta=1000000.0,
            norm_eps=1e-6,
            tie_embeddings=False,
            moe=dict(experts=8, experts_per_token=2, ffn_hidden=64, norm_topk_prob=True),
        ),
    },
)
