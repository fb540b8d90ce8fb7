"""A Hugging Face checkpoint's config.json, read into the model section's fields.

`model.init_from: DIR` takes the family, the shape, the norm epsilon, tied embeddings, RoPE and
the sliding window from DIR/config.json (the spec validates them, so this lives in contract);
the weights are read by the trainer (ctxlaunch/runtime/checkpointing/hf.py). The families of
`ctxlaunch.contract.families` are accepted (grouped-query attention, tied embeddings,
llama3/YaRN/linear RoPE scaling); any other architecture, and anything whose weights would not
mean the same in ctxlaunch's model, is refused by name, with what its block has that
ctxlaunch's lacks where transformers knows it.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from ctxlaunch.contract.bounded import MAX_CONFIG_BYTES, BoundedReadError, read_bounded_json
from ctxlaunch.contract.families import (
    FAMILIES,
    REFUSED,
    Family,
    family_of_architecture,
    family_of_model_type,
    supported_architectures,
)
from ctxlaunch.contract.families.experts import MoeConfigError

CONFIG_FILE = "config.json"

SHAPE_KEYS: dict[str, str] = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "ffn_hidden": "intermediate_size",
    "vocab": "vocab_size",
}
"""ModelSpec field -> config.json key (kv_heads, tie_embeddings and norm_eps have defaults in
transformers and are read apart)."""

ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
)
"""The RoPE-scaling parameters ctxlaunch reproduces (see `RopeScaling` in spec.py)."""


class HFConfigError(ValueError):
    """config.json is missing, unreadable, or describes a model ctxlaunch cannot train."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""ORG/NAME as the Hugging Face hub spells a repository (letters, digits, `-`, `_`, `.`)."""


def hub_id_error(init_from: str) -> str | None:
    """Why `init_from` cannot be read, when it is a Hugging Face hub id (ORG/NAME, such as
    meta-llama/Llama-3.2-1B) and no local path of that name exists: ctxlaunch reads local files
    only, so the answer is the command that downloads them. A relative directory that is not
    here yet is written ./ORG/NAME, which is never taken for a hub id."""
    if not _HUB_ID.fullmatch(init_from) or ".." in init_from or Path(init_from).exists():
        return None
    return (
        f"model.init_from {init_from}: a Hugging Face hub id, not a local directory; download "
        f"it with `hf download {init_from} --local-dir DIR` and set model.init_from: DIR "
        f"(a local directory that is not here yet: write it ./{init_from})"
    )


def read_config(directory: str | Path) -> dict[str, Any]:
    """DIR/config.json as a mapping, read with bounds: a regular file (a FIFO or a device is
    refused, not read) of at most MAX_CONFIG_BYTES, nested at most MAX_DEPTH deep."""
    path = Path(directory) / CONFIG_FILE
    if not os.path.lexists(path):
        raise HFConfigError(
            f"model.init_from: no {CONFIG_FILE} in {directory} (a Hugging Face "
            "checkpoint directory holds config.json and model.safetensors)"
        )
    try:
        data = read_bounded_json(path, MAX_CONFIG_BYTES, CONFIG_FILE)
    except BoundedReadError as exc:
        raise HFConfigError(f"model.init_from: {exc}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"model.init_from: {path} is not a JSON object")
    return data


def _number(config: dict[str, Any], key: str, default: float, where: str) -> float:
    """config[key] as a positive finite number (`default` when absent), else a sentence."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HFConfigError(f"{where}: {key} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise HFConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def rope_from_config(
    config: dict[str, Any], where: str, params: Any = None
) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the `rope_scaling` section in ctxlaunch's form) of a config.json, in either
    of transformers' spellings: `rope_theta` + `rope_scaling` (4.x, the released Llama 3.1
    files) or `rope_parameters` (5.x); `params`: the section a family reads (its full
    layers')."""
    if params is None:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise HFConfigError(f"{where}: rope_scaling must be an object, got {params!r}")
    theta = _number(params, "rope_theta", _number(config, "rope_theta", 10000.0, where), where)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise HFConfigError(
            f"{where}: RoPE type {kind!r} is not supported (ctxlaunch has "
            "default, linear, llama3 and yarn)"
        )
    scaling: dict[str, Any] = {"type": kind}
    for key in ROPE_KEYS:
        if key == "truncate" and params.get(key) is not None:
            # A flag, not a number (GPT-OSS's released files say false).
            if not isinstance(params[key], bool):
                raise HFConfigError(f"{where}: truncate must be true or false, got {params[key]!r}")
            scaling[key] = params[key]
        elif params.get(key) is not None:
            _number(params, key, 0.0, where)  # a number, or a sentence naming the key
            scaling[key] = params[key]
    if (
        kind in ("llama3", "yarn")
        and "original_max_position_embeddings" not in scaling
        and "max_position_embeddings" in config
    ):
        _number(config, "max_position_embeddings", 0.0, where)
        # transformers' default: the pretraining length is the config's maximum.
        scaling["original_max_position_embeddings"] = config["max_position_embeddings"]
    if kind == "yarn" and "factor" not in scaling:
        orig = scaling.get("original_max_position_embeddings")
        if orig and config.get("max_position_embeddings"):
            scaling["factor"] = config["max_position_embeddings"] / orig
    if kind == "default":
        scaling = {"type": "default"}
    return float(theta), scaling


def _family(config: dict[str, Any], where: str) -> Family:
    """The family config.json describes, or an HFConfigError naming the architecture and, for
    one transformers knows, what its block has that ctxlaunch's lacks."""
    listed = config.get("architectures") or []
    if not isinstance(listed, list):
        raise HFConfigError(f"{where}: architectures must be a list, got {listed!r}")
    architectures = [str(a) for a in listed]
    model_type = str(config.get("model_type"))
    family = family_of_model_type(model_type)
    if len(architectures) > 1:
        raise HFConfigError(
            f"{where}: architectures {', '.join(architectures)}: one causal LM expected"
        )
    if architectures:
        by_class = family_of_architecture(architectures[0])
        if by_class is not None and architectures[0] in by_class.wrappers:
            # A wrapper (a multimodal class) around the family's decoder: its own model_type.
            if by_class.wrappers[architectures[0]] == model_type:
                return by_class
        if by_class is None or (family is not None and family is not by_class):
            lacking = REFUSED.get(model_type)
            raise HFConfigError(
                f"{where}: architecture {architectures[0]} (model_type {model_type!r}) is not "
                "supported"
                + (f": its block has {lacking}" if lacking else "")
                + f"; model.init_from takes {supported_architectures()}"
            )
        family = family or by_class
    if family is None or family.model_type != model_type:
        lacking = REFUSED.get(model_type)
        raise HFConfigError(
            f"{where}: model_type {model_type!r} is not supported"
            + (f": its block has {lacking}" if lacking else "")
            + "; model.init_from takes model_type "
            + ", ".join(f.model_type for f in FAMILIES.values())
        )
    return family


def _biased_families() -> str:
    """Which families have q/k/v biases, for the message refusing them elsewhere."""
    kinds = {
        "on q, k and v only": [f.name for f in FAMILIES.values() if f.qkv_bias and not f.o_bias],
        "on q, k, v and o": [f.name for f in FAMILIES.values() if f.o_bias],
    }
    said = [f"{', '.join(names)}: {where}" for where, names in kinds.items() if names]
    return f" (biases in {'; '.join(said)})" if said else ""


def model_fields(directory: str | Path) -> dict[str, Any]:
    """The ModelSpec fields DIR/config.json determines, after refusing what ctxlaunch cannot
    reproduce (another architecture, biases it has no place for, an activation other than
    SiLU)."""
    outer = read_config(directory)
    where = str(Path(directory) / CONFIG_FILE)
    family = _family(outer, where)
    try:
        config = family.text_config(outer)
    except ValueError as exc:
        raise HFConfigError(f"{where}: {exc}") from None
    missing = [
        key
        for key in SHAPE_KEYS.values()
        if isinstance(config.get(key), bool) or not isinstance(config.get(key), int)
    ]
    if missing:
        raise HFConfigError(f"{where}: missing or non-integer {', '.join(missing)}")
    not_positive = [key for key in SHAPE_KEYS.values() if config[key] < 1]
    if not_positive:
        # A shape of 0 would divide by zero below (hidden_size / num_attention_heads).
        raise HFConfigError(
            f"{where}: {', '.join(f'{key} = {config[key]}' for key in not_positive)}: "
            "a model's sizes are positive"
        )
    for key in ("head_dim", "num_key_value_heads"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise HFConfigError(f"{where}: {key} must be an integer, got {value!r}")
        if value is not None and value < 1:
            # transformers builds such a model as given (0 heads, 0-wide heads), never as the
            # default: refused, not silently replaced.
            raise HFConfigError(f"{where}: {key} = {value}: a model's sizes are positive")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag) and not (flag == "attention_bias" and family.o_bias):
            raise HFConfigError(
                f"{where}: {flag} is true; ctxlaunch's {family.architecture} has no biases there"
                + (_biased_families() if flag == "attention_bias" else "")
            )
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    wanted = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}
    if act not in wanted[family.activation]:
        raise HFConfigError(
            f"{where}: hidden_act {act!r} is not supported ({family.architecture}'s "
            f"feed-forward is gated by {wanted[family.activation][0]})"
        )
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if not config.get("head_dim") and hidden % heads:
        raise HFConfigError(
            f"{where}: head_dim {config.get('head_dim')!r} is not a whole number and "
            f"hidden_size / num_attention_heads = {hidden} / {heads} is not whole either"
        )
    if config.get("pretraining_tp", 1) not in (1, None):
        raise HFConfigError(
            f"{where}: pretraining_tp = {config['pretraining_tp']} is not supported (1 only)"
        )
    theta, scaling = rope_from_config(config, where, family.rope_parameters(config))
    try:
        extra = family.config_fields(config)
        layer_types = family.layer_types(config)
    except ValueError as exc:
        raise HFConfigError(f"{where}: {exc}") from None
    fields: dict[str, Any] = {name: config[key] for name, key in SHAPE_KEYS.items()}
    fields.update(
        family=family.name,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        norm_eps=_number(config, "rms_norm_eps", 1e-6, where),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=family.sliding_window(config),
        layer_types=layer_types,
        **extra,
    )
    try:
        fields["moe"] = family.moe_fields(config, where)
    except MoeConfigError as exc:
        raise HFConfigError(str(exc)) from None
    return fields


def checkpoint_dtype(directory: str | Path) -> str | None:
    """The dtype config.json records (torch's name, e.g. bfloat16), if any."""
    config = read_config(directory)
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value) if value else None
