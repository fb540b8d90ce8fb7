"""GPT-OSS: the common block with biases on the q, k, v and o projections, a learned sink
logit per head, sliding-window (128) layers alternating with full ones, YaRN RoPE, and a
mixture-of-experts feed-forward on every layer: a router with a bias that takes the top-k of
its logits and softmaxes over those k, experts with biases whose activation is the clamped
SwiGLU ((up + 1) x gate x sigmoid(alpha x gate), gate and up clamped), no shared expert. Its
checkpoints stack a layer's experts in one tensor per projection, gate and up interleaved
(`StackedExperts`).

The released checkpoints keep the experts quantized (MXFP4: `*_blocks` and `*_scales`
tensors, config.json's quantization_config); ctxlaunch reads the dequantized layout that
transformers' save_pretrained writes of a model loaded with dequantize=True."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxlaunch.contract.families.experts import (
    ExpertNames,
    MoeConfigError,
    StackedExperts,
    moe_config_fields,
    moe_export_keys,
)
from ctxlaunch.contract.families.family import (
    BlockShape,
    Family,
    WindowedShape,
    hf_layer_types,
    read_layer_types,
)

GPT_OSS_DEFAULTS: dict[str, Any] = {
    "sliding_window": 128,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "head_dim": 64,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001,
    "rope_theta": 150000.0,
}
"""What transformers' GptOssConfig assumes of a key config.json leaves out (its defaults:
configuration_gpt_oss.py)."""


GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""GptOssConfig's RoPE where config.json states none (its default rope_parameters)."""


class GptOss(Family):
    """Every other layer local (the first one local) unless config.json lists the layers'
    kinds; YaRN unless config.json says otherwise; the experts' keys as GptOssConfig names
    them; quantized checkpoints refused."""

    def rope_parameters(self, config: Mapping[str, Any]) -> Any:
        return config.get("rope_parameters") or config.get("rope_scaling") or GPT_OSS_ROPE

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        window = config.get("sliding_window")
        return int(window) if window else None

    def layer_types(self, config: Mapping[str, Any]) -> tuple[str, ...] | None:
        if not config.get("sliding_window"):
            return None
        return read_layer_types(config) or ("local", "full")

    def config_fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        if config.get("quantization_config"):
            raise ValueError(
                "quantization_config is set: the experts are stored quantized (MXFP4); load the "
                "checkpoint in transformers with Mxfp4Config(dequantize=True), save_pretrained "
                "it, and point model.init_from at that directory"
            )
        if not config.get("attention_bias"):
            raise ValueError(
                "attention_bias is false: ctxlaunch's GPT-OSS block has biases on q, k, v and o"
            )
        return {}

    def moe_fields(self, config: Mapping[str, Any], where: str) -> dict[str, Any] | None:
        fields = moe_config_fields(
            config,
            where,
            expert_width_key="intermediate_size",
            shared_width_key=None,
            renormalises=True,
        )
        for key in ("swiglu_limit", "swiglu_alpha"):
            value = config.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise MoeConfigError(f"{where}: {key} must be a positive number, got {value!r}")
            fields[key] = float(value)
        return fields

    def moe_problem(self, model: BlockShape) -> str | None:
        moe = model.moe
        if moe is None:
            return None
        if moe.layer_step != 1 or moe.dense_layers:
            return "every GPT-OSS layer is a mixture of experts: layer_step 1, no dense_layers"
        if moe.ffn_hidden != model.ffn_hidden:
            return (
                f"GPT-OSS's experts are intermediate_size wide: moe.ffn_hidden = "
                f"{moe.ffn_hidden} must equal model.ffn_hidden = {model.ffn_hidden}"
            )
        return None

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        keys: dict[str, Any] = {
            "attention_bias": True,
            "sliding_window": model.sliding_window,
            "layer_types": hf_layer_types(model),
            # transformers writes its YaRN RoPE into rope_parameters itself when
            # rope_scaling (4.x's spelling, written by the common keys) is read.
        }
        moe = model.moe
        if moe is not None:
            keys |= moe_export_keys(
                moe, expert_width_key="intermediate_size", sparse_layer_keys=False
            )
            keys |= {
                "num_local_experts": moe.experts,
                "router_aux_loss_coef": moe.aux_loss_coef,
                "swiglu_limit": moe.swiglu_limit,
                "swiglu_alpha": moe.swiglu_alpha,
            }
        return keys


# The released models' RoPE (config.json of openai/gpt-oss-20b and -120b, and GptOssConfig's
# default rope_parameters): YaRN stretching a 4,096-token pretraining length 32 times, base
# 150,000.
_YARN = {"type": "yarn", **{k: v for k, v in GPT_OSS_ROPE.items() if k != "rope_type"}}
_GPT_OSS = dict(
    hidden=2880,
    heads=64,
    kv_heads=8,
    head_dim=64,
    ffn_hidden=2880,
    vocab=201088,
    rope_theta=150000.0,
    rope_scaling=_YARN,
    norm_eps=1e-5,
    tie_embeddings=False,
    sliding_window=128,
    layer_types=("local", "full"),
)

FAMILY = GptOss(
    name="gpt_oss",
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    releases="gpt-oss (20b, 120b)",
    qkv_bias=True,
    o_bias=True,
    attention_sinks=True,
    experts=ExpertNames(
        router="mlp.router.weight", router_bias="mlp.router.bias", stacked=StackedExperts()
    ),
    router_renormalises=True,
    router_top_k_first=True,
    expert_biases=True,
    clamped_swiglu=True,
    config_defaults=GPT_OSS_DEFAULTS,
    presets={
        # gpt-oss-20b and gpt-oss-120b (config.json of openai/gpt-oss-20b and
        # openai/gpt-oss-120b: 24 and 36 layers, 32 and 128 experts of 2,880, top-4, hidden
        # 2,880, 64 query and 8 K/V heads of 64, sliding window 128 on every other layer from
        # the first, swiglu_limit 7.0; the model card's totals: 21B and 117B parameters,
        # 3.6B and 5.1B active).
        "gpt-oss-20b": dict(
            layers=24,
            moe=dict(
                experts=32,
                experts_per_token=4,
                ffn_hidden=2880,
                norm_topk_prob=True,
                aux_loss_coef=0.9,
                swiglu_limit=7.0,
                swiglu_alpha=1.702,
            ),
            **_GPT_OSS,
        ),
        "gpt-oss-120b": dict(
            layers=36,
            moe=dict(
                experts=128,
                experts_per_token=4,
                ffn_hidden=2880,
                norm_topk_prob=True,
                aux_loss_coef=0.9,
                swiglu_limit=7.0,
                swiglu_alpha=1.702,
            ),
            **_GPT_OSS,
        ),
    },
)
