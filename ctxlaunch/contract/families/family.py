"""What a decoder family is: its Hugging Face names, the parts its block adds to the common
one, how its config.json says what ctxlaunch reads, and its presets.

Every family starts from one block (RMSNorm, RoPE, grouped-query attention, SwiGLU) and differs
from it only through what its `Family` says. The rest of ctxlaunch asks the family and never
names it: the spec reads its parts and presets, the config.json reader its window, the
trainer's Hugging Face import and export its tensor names and config keys, the planner its
parts (through the model section's `qkv_bias` and `qk_norm`). A new family with the parts
that exist is one module beside this one, registered in `__init__.py`.

    ctxlaunch parameter              Hugging Face tensor(s)
    embed.weight                     model.embed_tokens.weight
    blocks.{i}.attn_norm.weight      model.layers.{i}.input_layernorm.weight
    blocks.{i}.attn.wqkv.weight      model.layers.{i}.self_attn.{q,k,v}_proj.weight (dim 0)
    blocks.{i}.attn.wqkv.bias        model.layers.{i}.self_attn.{q,k,v}_proj.bias (qkv_bias)
    blocks.{i}.attn.q_norm.weight    model.layers.{i}.self_attn.q_norm.weight (qk_norm)
    blocks.{i}.attn.k_norm.weight    model.layers.{i}.self_attn.k_norm.weight (qk_norm)
    blocks.{i}.attn.wo.weight        model.layers.{i}.self_attn.o_proj.weight
    blocks.{i}.attn.wo.bias          model.layers.{i}.self_attn.o_proj.bias (o_bias)
    blocks.{i}.ffn_norm.weight       model.layers.{i}.post_attention_layernorm.weight
    blocks.{i}.ffn.w_gate_up.weight  model.layers.{i}.mlp.{gate,up}_proj.weight (dim 0)
    blocks.{i}.ffn.w_down.weight     model.layers.{i}.mlp.down_proj.weight
    blocks.{i}.attn.sinks            model.layers.{i}.self_attn.sinks (attention_sinks)
    norm.weight                      model.norm.weight
    head.weight                      lm_head.weight (absent when tied)

A family with norms after each sub-block (`post_norms`, Gemma's naming) renames two of them:

    blocks.{i}.attn_post_norm.weight model.layers.{i}.post_attention_layernorm.weight
    blocks.{i}.ffn_norm.weight       model.layers.{i}.pre_feedforward_layernorm.weight
    blocks.{i}.ffn_post_norm.weight  model.layers.{i}.post_feedforward_layernorm.weight

Hugging Face's q/k projections (and their biases) are already in the rotate-half layout that
the trainer's RoPE uses, so they are copied as they are. A family whose feed-forward is a
mixture of experts (`Family.experts`) has, in the layers its model section's `moe` marks, the
router and expert parameters of `experts.py` in place of `ffn.w_gate_up` and `ffn.w_down`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ctxlaunch.contract.families.experts import (
    ExpertNames,
    ExpertsShape,
    expert_hf_names,
    expert_part_rows,
    is_expert_parameter,
    is_moe_parameter,
    moe_block_shapes,
    stacked_shape,
)


class BlockShape(Protocol):
    """What a family's tensors are made of: the model section's shape and parts (a ModelSpec
    satisfies it)."""

    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def post_norms(self) -> bool: ...
    @property
    def attention_sinks(self) -> bool: ...
    @property
    def moe(self) -> ExpertsShape | None: ...
    @property
    def shared_expert(self) -> bool: ...
    @property
    def expert_biases(self) -> bool: ...


class WindowedShape(BlockShape, Protocol):
    """A shape with the attention windows and the scores it was trained with (what an export
    writes)."""

    @property
    def sliding_window(self) -> int | None: ...
    @property
    def layer_windows(self) -> tuple[int | None, ...]: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def local_rope_theta(self) -> float | None: ...
    @property
    def query_pre_attn_scalar(self) -> float | None: ...
    @property
    def attention_softcap(self) -> float | None: ...
    @property
    def logit_softcap(self) -> float | None: ...


TOP_WEIGHTS: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
"""ctxlaunch's parameters outside the blocks -> their Hugging Face tensors."""

BLOCK_WEIGHTS: dict[str, tuple[str, ...]] = {
    "attn_norm.weight": ("input_layernorm.weight",),
    "attn.wqkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attn.wqkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
    "attn.wo.weight": ("self_attn.o_proj.weight",),
    "attn.wo.bias": ("self_attn.o_proj.bias",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
    "ffn.w_gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "ffn.w_down.weight": ("mlp.down_proj.weight",),
    "attn.sinks": ("self_attn.sinks",),
}
"""A block's parameters (under `blocks.{i}.`) -> their Hugging Face tensors under
`model.layers.{i}.`, in order: a fused projection is its parts concatenated along dim 0."""

POST_NORM_WEIGHTS: dict[str, tuple[str, ...]] = {
    "attn_post_norm.weight": ("post_attention_layernorm.weight",),
    "ffn_norm.weight": ("pre_feedforward_layernorm.weight",),
    "ffn_post_norm.weight": ("post_feedforward_layernorm.weight",),
}
"""What a family with `post_norms` names differently (Gemma's names): the norm before the
feed-forward is its `pre_feedforward_layernorm`, and `post_attention_layernorm` is the norm
after attention."""

LAYER_TYPES = {"full": "full_attention", "local": "sliding_attention"}
"""A layer's kind (the spec's `layer_types`) -> transformers' name of it in config.json."""

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def parameter_shapes(model: BlockShape) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model the trainer builds, by its name, with its shape."""
    h, f, v = model.hidden, model.ffn_hidden, model.vocab
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h), "norm.weight": (h,)}
    if not model.tie_embeddings:
        shapes["head.weight"] = (v, h)
    block: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn.wqkv.weight": (q + 2 * kv, h),
        "attn.wo.weight": (h, q),
        "ffn.w_gate_up.weight": (2 * f, h),
        "ffn.w_down.weight": (h, f),
    }
    if model.qkv_bias:
        block["attn.wqkv.bias"] = (q + 2 * kv,)
    if model.o_bias:
        block["attn.wo.bias"] = (h,)
    if model.qk_norm:
        block["attn.q_norm.weight"] = block["attn.k_norm.weight"] = (model.head_dim,)
    if model.post_norms:
        block["attn_post_norm.weight"] = block["ffn_post_norm.weight"] = (h,)
    if model.attention_sinks:
        block["attn.sinks"] = (model.heads,)
    moe = model.moe
    sparse = block.copy()
    if moe is not None:
        del sparse["ffn.w_gate_up.weight"], sparse["ffn.w_down.weight"]
        sparse |= moe_block_shapes(h, moe, model.shared_expert, model.expert_biases)
    for i in range(model.layers):
        leaves = sparse if moe is not None and moe.is_moe_layer(i) else block
        shapes |= {f"blocks.{i}.{leaf}": shape for leaf, shape in leaves.items()}
    return shapes


def part_rows(name: str, model: BlockShape) -> tuple[int, ...]:
    """Rows (dim 0; of a mixture-of-experts parameter's 2-D view, `experts.py`) of each Hugging
    Face part of parameter `name`; () for a parameter that is one tensor."""
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    if model.moe is not None and is_moe_parameter(name):
        return expert_part_rows(name.split(".", 2)[-1], model.hidden, model.moe)
    if name.endswith(("wqkv.weight", "wqkv.bias")):
        return (q, kv, kv)
    if name.endswith("w_gate_up.weight"):
        return (model.ffn_hidden, model.ffn_hidden)
    return ()


@dataclass(frozen=True)
class Family:
    """One decoder family. A family whose config.json or export differs from the common
    block's overrides `sliding_window` or `export_keys`."""

    name: str
    """ctxlaunch's name (`model.family`)."""
    architecture: str
    """The transformers class of its checkpoints (config.json's `architectures`)."""
    model_type: str
    """config.json's `model_type`."""
    releases: str
    """The released models of the family, for messages and docs."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections."""
    o_bias: bool = False
    """A bias on the attention's output projection too (added once, after TP's reduce)."""
    qk_norm: bool = False
    """An RMSNorm (weight of head_dim) over each head of q and of k, before RoPE."""
    norm_offset: bool = False
    """RMSNorm gains (the q/k norms' too) are stored as w and applied as 1 + w."""
    post_norms: bool = False
    """An RMSNorm on each sub-block's output too, before the residual add (and the names of
    `POST_NORM_WEIGHTS`)."""
    activation: Literal["silu", "gelu_tanh"] = "silu"
    """The feed-forward gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU, GELU's tanh
    approximation, transformers' gelu_pytorch_tanh)."""
    embedding_scale: bool = False
    """The embedding's output is multiplied by sqrt(hidden) (rounded to the weights' dtype)."""
    attention_sinks: bool = False
    """A learned logit per query head in every softmax denominator, carrying no value."""
    experts: ExpertNames | None = None
    """The feed-forward of the layers the model section's `moe` marks is a mixture of experts,
    whose tensors a checkpoint keeps under these names; None: every layer is dense."""
    shared_expert: bool = False
    """Beside the routed experts, a shared expert every token passes through, scaled by a
    sigmoid gate of the token (`ffn.shared`, `ffn.shared_gate`)."""
    router_renormalises: bool = False
    """The router always renormalises the top-k probabilities to sum to 1 (config.json has no
    norm_topk_prob); otherwise `moe.norm_topk_prob` says."""
    router_top_k_first: bool = False
    """The router takes the top-k of its logits and softmaxes over those k alone, instead of a
    softmax over every expert then the top-k (the weights sum to 1 either way where
    renormalised; the load-balancing loss still reads the softmax over every expert)."""
    expert_biases: bool = False
    """Biases on the router and on each expert's gate/up and down projections."""
    clamped_swiglu: bool = False
    """The experts' activation is the clamped SwiGLU: gate clamped to at most
    `moe.swiglu_limit`, up to within it, out = (up + 1) x gate x sigmoid(swiglu_alpha x gate)."""
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Named shapes of the family's released models (`model: {preset: NAME}`)."""
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    """What transformers' config class assumes where a config.json leaves a key out (an export
    by save_pretrained writes only the keys that differ from them), where it differs from the
    common block's."""
    wrappers: Mapping[str, str] = field(default_factory=dict)
    """Other transformers classes, by architecture, with their model_type, whose checkpoints
    hold this family's decoder as their text model: its config under `text_config`, its
    tensors under one of `wrapped_prefixes` instead of `model.`."""
    wrapped_prefixes: tuple[str, ...] = ()
    """Where a wrapper's checkpoint keeps the text model's `model.` tensors."""

    def sliding_window(self, config: Mapping[str, Any]) -> int | None:
        """The attention window some layer of a checkpoint of this family uses, as
        transformers reads its config.json (None: every layer attends to the whole causal
        prefix). The common block has none."""
        return None

    def layer_types(self, config: Mapping[str, Any]) -> tuple[str, ...] | None:
        """Which layers are local ("local") and which full ("full"), as the spec's
        `layer_types` takes them, when some layer has the window (None: every layer has it)."""
        return None

    def config_fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The model section's fields this family's config.json sets beyond the common ones
        (the attention scale, soft-caps, the local layers' RoPE base). A ValueError, one
        sentence naming the key, for a value ctxlaunch cannot reproduce."""
        return {}

    def rope_parameters(self, config: Mapping[str, Any]) -> Any:
        """The RoPE section of config.json the full layers use (transformers 5's
        `rope_parameters`, or 4.x's `rope_scaling`; None: neither)."""
        return config.get("rope_parameters") or config.get("rope_scaling")

    def text_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The decoder's config: config.json itself, or a wrapper's `text_config`."""
        if config.get("architectures") and str(config["architectures"][0]) in self.wrappers:
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"{config['architectures'][0]}: text_config must be an object")
            return {**self.config_defaults, **text}
        return {**self.config_defaults, **config}

    def export_keys(self, model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
        """config.json keys an export writes for this family beyond the common ones (`base`:
        the keys of the init_from config, kept unless the model decides them)."""
        return {"attention_bias": False, "mlp_bias": False}

    def moe_fields(self, config: Mapping[str, Any], where: str) -> dict[str, Any] | None:
        """The model section's `moe` fields of a checkpoint's config.json (`where` names it in
        messages); None for a dense family. A family with experts overrides it
        (`experts.moe_config_fields`)."""
        return None

    def moe_problem(self, model: BlockShape) -> str | None:
        """Why `model`'s `moe` is not one this family's checkpoints can state (its config.json
        has no key for it), or None."""
        return None

    def hf_names(self, name: str) -> tuple[str, ...]:
        """The Hugging Face tensors that make up ctxlaunch parameter `name`, in order (the
        fused projections are several, concatenated along dim 0)."""
        if name in TOP_WEIGHTS:
            return (TOP_WEIGHTS[name],)
        weights = BLOCK_WEIGHTS | (POST_NORM_WEIGHTS if self.post_norms else {})
        match = _BLOCK.match(name)
        if match and self.experts is not None and is_moe_parameter(name):
            if is_expert_parameter(name) and self.experts.stacked is None:
                # The expert count is the number of names: the model's shape decides it.
                raise KeyError(f"{name!r} holds every expert's tensors: use hf_parts")
            return tuple(
                f"model.layers.{match.group(1)}.{part}"
                for part in expert_hf_names(match.group(2), self.experts, 0)
            )
        if match and match.group(2) in weights:
            return tuple(
                f"model.layers.{match.group(1)}.{part}" for part in weights[match.group(2)]
            )
        raise KeyError(f"no Hugging Face name for parameter {name!r}")

    def stored_name(self, hf_name: str, names: Any) -> str:
        """Where a checkpoint holding tensors `names` keeps `hf_name` (a `model.` tensor of a
        wrapper's checkpoint lives under one of `wrapped_prefixes`)."""
        if hf_name in names or not hf_name.startswith("model."):
            return hf_name
        for prefix in self.wrapped_prefixes:
            moved = prefix + hf_name.removeprefix("model.")
            if moved in names:
                return moved
        return hf_name

    def hf_parts(
        self, name: str, shape: tuple[int, ...], model: BlockShape
    ) -> list[tuple[str, tuple[int, ...]]]:
        """The Hugging Face tensors that make up parameter `name` (of `shape`) of a model of
        this shape, in order, each with its shape: the parts of a fused projection along dim 0,
        those of a mixture-of-experts parameter along the rows of its 2-D view
        (`experts.py`)."""
        match = _BLOCK.match(name)
        experts = self.experts
        if match and experts and experts.stacked is not None and is_expert_parameter(name):
            # One tensor of all the layer's experts, in the checkpoint's own layout.
            (hf_name,) = expert_hf_names(match.group(2), experts, 0)
            leaf_shape = stacked_shape(match.group(2), shape)
            return [(f"model.layers.{match.group(1)}.{hf_name}", leaf_shape)]
        rows = part_rows(name, model) or (shape[0],)
        if match and model.moe is not None and self.experts is not None and is_moe_parameter(name):
            names = expert_hf_names(match.group(2), self.experts, model.moe.experts)
            hf = [f"model.layers.{match.group(1)}.{part}" for part in names]
        else:
            hf = list(self.hf_names(name))
        tail = shape[-1:] if len(shape) == 3 else shape[1:]
        return [(n, (r, *tail)) for n, r in zip(hf, rows, strict=True)]

    def hf_tensors(self, model: BlockShape) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor a checkpoint of this shape holds for the model, with its
        shape (tensors the model does not read, such as a tied lm_head, are not listed)."""
        return {
            hf_name: part
            for name, shape in parameter_shapes(model).items()
            for hf_name, part in self.hf_parts(name, shape, model)
        }


def read_layer_types(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """config.json's `layer_types` as the spec's kinds (None when absent); a ValueError for a
    kind other than full or sliding attention."""
    listed = config.get("layer_types")
    if listed is None:
        return None
    names = {hf: ours for ours, hf in LAYER_TYPES.items()}
    if not isinstance(listed, list) or any(kind not in names for kind in listed):
        raise ValueError(
            f"layer_types {listed!r}: each layer must be full_attention or sliding_attention"
        )
    return tuple(names[kind] for kind in listed)


def layered_types(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The layers' kinds of a config.json that turns the window on with `use_sliding_window`
    and applies it to the layers `layer_types` marks sliding (by default, from
    `max_window_layers` on); None when no layer has it."""
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or not window:
        return None
    layers = int(config.get("num_hidden_layers") or 0)
    kinds = read_layer_types(config)
    if kinds is None:
        first = int(config.get("max_window_layers", layers))
        kinds = tuple("local" if i >= first else "full" for i in range(layers))
    return kinds if "local" in kinds else None


def layered_window(config: Mapping[str, Any]) -> int | None:
    """The window of a config.json that turns it on with `use_sliding_window` and applies it
    to the layers `layer_types` marks sliding (by default, from `max_window_layers` on)."""
    return int(config["sliding_window"]) if layered_types(config) is not None else None


def hf_layer_types(model: WindowedShape) -> list[str]:
    """Every layer's kind as transformers names it in config.json."""
    return [LAYER_TYPES["full" if w is None else "local"] for w in model.layer_windows]


def layered_window_keys(model: WindowedShape, base: Mapping[str, Any]) -> dict[str, Any]:
    """The keys that say `layered_window`'s window as the model was trained: off when the spec
    turned it off, else on the layers the spec makes local."""
    keys: dict[str, Any] = {"use_sliding_window": model.sliding_window is not None}
    if model.sliding_window is not None:
        keys["sliding_window"] = model.sliding_window
        keys["layer_types"] = hf_layer_types(model)
    elif "layer_types" in base:
        # transformers reads the layers' kinds from here before use_sliding_window.
        keys["layer_types"] = ["full_attention"] * model.layers
    return keys
