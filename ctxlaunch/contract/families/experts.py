"""The mixture-of-experts part of a block, as families describe it: which layers route their
tokens to experts, the parameters such a layer holds, their Hugging Face names, and the
config.json keys that state them.

A mixture-of-experts feed-forward (the `ffn` of a block the model section's `moe` marks) is a
router, E experts (SwiGLU each, of width f_e) and, in families with one, a shared expert
(SwiGLU of width f_s) whose output a sigmoid gate scales:

    ctxlaunch parameter               shape            Hugging Face tensor(s), under model.layers.{i}.
    blocks.{i}.ffn.router.weight      (E, h)           the router (`mlp.gate.weight`)
    blocks.{i}.ffn.experts.w_gate_up  (E, 2 f_e, h)    each expert's gate then up projection
    blocks.{i}.ffn.experts.w_down     (E, h, f_e)      each expert's down projection
    blocks.{i}.ffn.shared.w_gate_up.weight  (2 f_s, h) the shared expert's gate and up
    blocks.{i}.ffn.shared.w_down.weight     (h, f_s)   the shared expert's down
    blocks.{i}.ffn.shared_gate.weight       (1, h)     the shared expert's sigmoid gate

In families with biases on the router and the experts (`Family.expert_biases`), also:

    blocks.{i}.ffn.router.bias        (E,)             the router's bias
    blocks.{i}.ffn.experts.b_gate_up  (E, 2 f_e)       each expert's gate then up bias
    blocks.{i}.ffn.experts.b_down     (E, h)           each expert's down bias

The experts of a layer are one tensor each (what expert parallelism splits along dim 0 and what
a grouped GEMM reads); viewed as (E x 2 f_e, h) and (E x h, f_e), their Hugging Face parts are
its consecutive row blocks, expert by expert: gate_0, up_0, gate_1, up_1, ... and down_0,
down_1, ... (`expert_part_rows`). A family whose checkpoints keep a layer's experts stacked
(`StackedExperts`) has one Hugging Face tensor per expert parameter instead, laid out as x @ W
(the input dimension before the output one) with gate and up interleaved along the output
(gate the even columns, up the odd ones): the import and export turn it (runtime's hf.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class ExpertsShape(Protocol):
    """What a mixture-of-experts feed-forward is made of (the model section's `moe` satisfies
    it)."""

    @property
    def experts(self) -> int: ...
    @property
    def experts_per_token(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def shared_ffn_hidden(self) -> int | None: ...
    @property
    def layer_step(self) -> int: ...
    @property
    def dense_layers(self) -> list[int]: ...
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def aux_loss_coef(self) -> float: ...
    @property
    def capacity_factor(self) -> float | None: ...
    @property
    def swiglu_limit(self) -> float | None: ...
    @property
    def swiglu_alpha(self) -> float | None: ...

    def is_moe_layer(self, layer: int) -> bool: ...


@dataclass(frozen=True)
class StackedExperts:
    """Where a checkpoint that stacks a layer's experts keeps them, under `model.layers.{i}.`:
    one tensor per projection and bias, the experts first, each matrix (input, output), gate
    and up interleaved along the output (transformers' fused experts with biases)."""

    gate_up: str = "mlp.experts.gate_up_proj"
    """(E, h, 2 f_e): gate in the even columns, up in the odd ones."""
    gate_up_bias: str = "mlp.experts.gate_up_proj_bias"
    """(E, 2 f_e), interleaved as gate_up."""
    down: str = "mlp.experts.down_proj"
    """(E, f_e, h)."""
    down_bias: str = "mlp.experts.down_proj_bias"
    """(E, h)."""


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoints keep a mixture-of-experts block's tensors, under
    `model.layers.{i}.` (`{j}`: the expert's index)."""

    router: str = "mlp.gate.weight"
    router_bias: str = "mlp.gate.bias"
    gate: str = "mlp.experts.{j}.gate_proj.weight"
    up: str = "mlp.experts.{j}.up_proj.weight"
    down: str = "mlp.experts.{j}.down_proj.weight"
    shared_gate_up: tuple[str, str] = (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    )
    shared_down: str = "mlp.shared_expert.down_proj.weight"
    shared_gate: str = "mlp.shared_expert_gate.weight"
    stacked: StackedExperts | None = None
    """The experts as one tensor per projection (then `gate`, `up` and `down` are unused)."""


ROUTER = "ffn.router.weight"
ROUTER_BIAS = "ffn.router.bias"
EXPERTS_GATE_UP = "ffn.experts.w_gate_up"
EXPERTS_DOWN = "ffn.experts.w_down"
EXPERTS_GATE_UP_BIAS = "ffn.experts.b_gate_up"
EXPERTS_DOWN_BIAS = "ffn.experts.b_down"
SHARED_GATE_UP = "ffn.shared.w_gate_up.weight"
SHARED_DOWN = "ffn.shared.w_down.weight"
SHARED_GATE = "ffn.shared_gate.weight"
EXPERT_LEAVES = (EXPERTS_GATE_UP, EXPERTS_DOWN, EXPERTS_GATE_UP_BIAS, EXPERTS_DOWN_BIAS)
"""A block's parameters that hold one slice per expert (dim 0): what expert parallelism
splits."""
MOE_LEAVES = (ROUTER, ROUTER_BIAS, *EXPERT_LEAVES, SHARED_GATE_UP, SHARED_DOWN, SHARED_GATE)


def is_moe_parameter(name: str) -> bool:
    """Whether parameter `name` (of the whole model) belongs to a mixture-of-experts
    feed-forward."""
    return name.split(".", 2)[-1] in MOE_LEAVES


def is_expert_parameter(name: str) -> bool:
    """Whether parameter `name` holds one slice per expert (split by expert parallelism)."""
    return name.split(".", 2)[-1] in EXPERT_LEAVES


def moe_block_shapes(
    hidden: int, moe: ExpertsShape, shared_expert: bool, biases: bool = False
) -> dict[str, tuple[int, ...]]:
    """The feed-forward parameters of one mixture-of-experts block (under `blocks.{i}.`);
    `biases`: the router and the experts have them."""
    e, f, h = moe.experts, moe.ffn_hidden, hidden
    shapes: dict[str, tuple[int, ...]] = {
        ROUTER: (e, h),
        EXPERTS_GATE_UP: (e, 2 * f, h),
        EXPERTS_DOWN: (e, h, f),
    }
    if biases:
        shapes |= {ROUTER_BIAS: (e,), EXPERTS_GATE_UP_BIAS: (e, 2 * f), EXPERTS_DOWN_BIAS: (e, h)}
    if shared_expert and moe.shared_ffn_hidden:
        fs = moe.shared_ffn_hidden
        shapes |= {SHARED_GATE_UP: (2 * fs, h), SHARED_DOWN: (h, fs), SHARED_GATE: (1, h)}
    return shapes


def expert_part_rows(leaf: str, hidden: int, moe: ExpertsShape) -> tuple[int, ...]:
    """Rows of each Hugging Face part of a mixture-of-experts parameter, on its 2-D view
    (experts' tensors flattened over their first two dimensions); () for one tensor."""
    if leaf == EXPERTS_GATE_UP:
        return (moe.ffn_hidden,) * (2 * moe.experts)
    if leaf == EXPERTS_DOWN:
        return (hidden,) * moe.experts
    if leaf == SHARED_GATE_UP and moe.shared_ffn_hidden:
        return (moe.shared_ffn_hidden,) * 2
    return ()


def expert_hf_names(leaf: str, names: ExpertNames, experts: int) -> tuple[str, ...]:
    """The Hugging Face tensors (under `model.layers.{i}.`) of a mixture-of-experts
    parameter's leaf, in the order of `expert_part_rows`."""
    if leaf == ROUTER:
        return (names.router,)
    if leaf == ROUTER_BIAS:
        return (names.router_bias,)
    if names.stacked is not None and leaf in EXPERT_LEAVES:
        return (stacked_name(leaf, names.stacked),)
    if leaf == EXPERTS_GATE_UP:
        return tuple(name.format(j=j) for j in range(experts) for name in (names.gate, names.up))
    if leaf == EXPERTS_DOWN:
        return tuple(names.down.format(j=j) for j in range(experts))
    if leaf == SHARED_GATE_UP:
        return names.shared_gate_up
    if leaf == SHARED_DOWN:
        return (names.shared_down,)
    if leaf == SHARED_GATE:
        return (names.shared_gate,)
    raise KeyError(leaf)


def stacked_name(leaf: str, stacked: StackedExperts) -> str:
    """The stacked tensor (under `model.layers.{i}.`) of expert parameter leaf `leaf`."""
    return {
        EXPERTS_GATE_UP: stacked.gate_up,
        EXPERTS_DOWN: stacked.down,
        EXPERTS_GATE_UP_BIAS: stacked.gate_up_bias,
        EXPERTS_DOWN_BIAS: stacked.down_bias,
    }[leaf]


def stacked_shape(leaf: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stacked tensor's shape of expert parameter leaf `leaf` of `shape`: each matrix
    transposed (input first), the biases as they are."""
    return (shape[0], shape[2], shape[1]) if leaf in (EXPERTS_GATE_UP, EXPERTS_DOWN) else shape


# -- config.json ---------------------------------------------------------------------------------
class MoeConfigError(ValueError):
    """A config.json whose mixture-of-experts keys ctxlaunch cannot reproduce."""


def _whole(config: Mapping[str, Any], key: str, where: str, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MoeConfigError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    return value


def moe_config_fields(
    config: Mapping[str, Any],
    where: str,
    *,
    expert_width_key: str,
    shared_width_key: str | None,
    renormalises: bool,
) -> dict[str, Any]:
    """The model section's `moe` fields of a mixture-of-experts config.json, in transformers'
    keys: the expert count (`num_experts`, or `num_local_experts`), the experts per token,
    each expert's width (`expert_width_key`), the shared expert's (`shared_width_key`), which
    layers are sparse (`decoder_sparse_step`, `mlp_only_layers`), the router's renormalisation
    (`norm_topk_prob`, or always with `renormalises`) and the auxiliary loss's coefficient. A
    router that adds noise in training (`router_jitter_noise` above 0) is refused: its routing
    could not be reproduced."""
    experts = _whole(config, "num_experts", where) or _whole(config, "num_local_experts", where)
    top_k = _whole(config, "num_experts_per_tok", where)
    width = _whole(config, expert_width_key, where)
    if not experts or not top_k or not width:
        raise MoeConfigError(
            f"{where}: a mixture-of-experts config needs num_experts (or num_local_experts), "
            f"num_experts_per_tok and {expert_width_key}, each a positive integer"
        )
    jitter = config.get("router_jitter_noise") or 0
    if jitter:
        raise MoeConfigError(
            f"{where}: router_jitter_noise = {jitter!r} multiplies the router's input by noise "
            "in training, which ctxlaunch's router does not; set it to 0"
        )
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise MoeConfigError(f"{where}: mlp_only_layers must be a list of layer indices")
    coef = config.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, int | float) or coef < 0:
        raise MoeConfigError(f"{where}: router_aux_loss_coef must be a number >= 0, got {coef!r}")
    fields: dict[str, Any] = {
        "experts": experts,
        "experts_per_token": top_k,
        "ffn_hidden": width,
        "layer_step": _whole(config, "decoder_sparse_step", where, 1) or 1,
        "dense_layers": sorted(dense),
        "norm_topk_prob": True if renormalises else bool(config.get("norm_topk_prob", False)),
        "aux_loss_coef": float(coef),
    }
    if shared_width_key is not None:
        fields["shared_ffn_hidden"] = _whole(config, shared_width_key, where)
    return fields


def moe_export_keys(moe: ExpertsShape, *, expert_width_key: str, sparse_layer_keys: bool) -> dict:
    """The config.json keys that state `moe` in transformers' words (the inverse of
    `moe_config_fields`); `sparse_layer_keys`: the family's config names its sparse layers
    (decoder_sparse_step, mlp_only_layers)."""
    keys: dict[str, Any] = {
        "num_experts_per_tok": moe.experts_per_token,
        expert_width_key: moe.ffn_hidden,
    }
    if sparse_layer_keys:
        keys |= {"decoder_sparse_step": moe.layer_step, "mlp_only_layers": list(moe.dense_layers)}
    return keys
