"""The model section of the job spec: a Llama-style decoder's family, shape and RoPE scaling,
given in full, from a preset, or from a Hugging Face checkpoint (init_from); which of its layers
are local (a sliding window) and which global, with the RoPE base of each kind."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ctxlaunch.contract.families import FAMILIES, MODEL_PRESETS, FamilyName
from ctxlaunch.contract.families.hfconfig import (
    CONFIG_FILE,
    HFConfigError,
    hub_id_error,
    model_fields,
)
from ctxlaunch.contract.families.hfweights import HFWeightsError, check_weights, has_weights
from ctxlaunch.contract.spec.fields import PositiveInt, _problem, _Strict
from ctxlaunch.contract.spec.moe_section import MoESpec


class DefaultRope(_Strict):
    """Plain RoPE: inverse frequencies theta^(-2i/d)."""

    type: Literal["default"] = "default"


class LinearRope(_Strict):
    """Position interpolation: every inverse frequency divided by `factor`."""

    type: Literal["linear"] = "linear"
    factor: float = Field(ge=1)
    """How many times the context is stretched."""


class Llama3Rope(_Strict):
    """Llama 3.1's scaling: low frequencies divided by `factor`, high ones kept, the band
    between interpolated smoothly (transformers' `_compute_llama3_parameters`)."""

    type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, ge=1)
    """Division of the low frequencies (8 in Llama 3.1)."""
    low_freq_factor: float = Field(1.0, gt=0)
    """Wavelengths above original_max_position_embeddings / low_freq_factor are scaled."""
    high_freq_factor: float = Field(4.0, gt=0)
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: PositiveInt = 8192
    """The context length the model was pretrained at (8192 in Llama 3.1)."""

    @model_validator(mode="after")
    def _band(self) -> Llama3Rope:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor = {self.high_freq_factor} must exceed "
                f"low_freq_factor = {self.low_freq_factor}"
            )
        return self


class YarnRope(_Strict):
    """YaRN (transformers' `_compute_yarn_parameters`): frequencies blended between
    interpolation and extrapolation by a ramp between the beta_fast and beta_slow rotation
    counts, and cos/sin multiplied by an attention factor."""

    type: Literal["yarn"] = "yarn"
    factor: float = Field(ge=1)
    """How many times the context is stretched."""
    original_max_position_embeddings: PositiveInt
    """The context length the model was pretrained at."""
    beta_fast: float = Field(32.0, gt=0)
    """Rotations below which a dimension is interpolated fully."""
    beta_slow: float = Field(1.0, gt=0)
    """Rotations above which a dimension is extrapolated (kept)."""
    attention_factor: float | None = Field(None, gt=0)
    """The cos/sin multiplier; default 0.1 ln(factor) + 1 (or the mscale ratio)."""
    mscale: float | None = None
    """With mscale_all_dim, the default attention factor is
    (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1) (DeepSeek's form)."""
    mscale_all_dim: float | None = None
    """See mscale."""
    truncate: bool = True
    """Round the ramp's ends to whole dimensions (transformers' default)."""


RopeScaling = Annotated[
    DefaultRope | LinearRope | Llama3Rope | YarnRope, Field(discriminator="type")
]
"""RoPE frequency scaling, as transformers computes it, chosen by `type`."""

LayerKind = Literal["full", "local"]
"""A layer's attention: full (the whole causal prefix) or local (the last sliding_window
tokens)."""

SHAPE_FIELDS = (
    "family",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden",
    "vocab",
    "norm_eps",
    "tie_embeddings",
)
"""What `init_from`'s config.json fixes: a spec may repeat these, but must agree."""

MOE_TRAINING_FIELDS = ("aux_loss_coef", "capacity_factor")
"""The `moe` fields a spec may set beside `init_from` (how to train, not what the model is);
the others come from config.json and must agree."""


class ModelSpec(_Strict):
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU; with its family's
    additions (q/k/v biases, q/k norms)."""

    preset: str | None = None
    """Start from a named shape (a family's preset: `ctxlaunch.contract.families`); fields
    given beside it override it."""
    init_from: str | None = None
    """A Hugging Face checkpoint directory of a family ctxlaunch trains (its causal LM class;
    config.json and model.safetensors, or shards with model.safetensors.index.json): the
    family, shape, norm_eps, tie_embeddings, rope_theta, rope_scaling and sliding_window come
    from its config.json, and training starts from its
    weights (each rank reads only the slice it holds). Shape fields given beside it must agree
    with config.json; rope_theta, rope_scaling and sliding_window given beside it override it
    (to extend the context)."""
    family: FamilyName = "llama"
    """The decoder family (`ctxlaunch.contract.families`): the common block (llama) or a
    family that adds its own parts to it (q/k/v biases, q/k norms). Set by init_from's
    config.json or by a preset; export writes the family's own Hugging Face class."""
    layers: PositiveInt
    """Transformer blocks."""
    hidden: PositiveInt
    """Model width h."""
    heads: PositiveInt
    """Query heads."""
    kv_heads: PositiveInt
    """Key/value heads (GQA); must divide heads."""
    # A None default stands for hidden / heads until `_check_shape` fills it in, so every
    # reader sees an int.
    head_dim: PositiveInt = Field(None, validate_default=False)  # type: ignore[assignment]  # see above
    """Width of each attention head; omitted: hidden / heads. Some families set it apart from
    the hidden size (hidden 4,096 with 32 heads of 128, say)."""
    ffn_hidden: PositiveInt
    """SwiGLU inner width."""
    vocab: PositiveInt
    """Vocabulary size (byte-level text data needs at least 256)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Training precision: bf16 (mixed precision with fp32 master weights) or plain fp32."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    rope_scaling: RopeScaling = DefaultRope()
    """RoPE frequency scaling: {type: default}, {type: linear, factor}, {type: llama3, factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings} (Llama 3.1) or
    {type: yarn, factor, original_max_position_embeddings, beta_fast, beta_slow,
    attention_factor, ...}, computed as transformers does."""
    norm_eps: float = Field(1e-5, gt=0)
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""
    moe: MoESpec | None = None
    """The mixture-of-experts feed-forward, for the families whose block has one (their
    presets and config.json set it); null for a dense model."""
    sliding_window: PositiveInt | None = None
    """The window of the local layers (as the checkpoint's config.json states it): a query of
    a local layer sees the last sliding_window tokens, itself included (transformers'
    sliding-window mask); under CP a local layer's ranks exchange only those keys. null: no
    local layer."""
    layer_types: tuple[LayerKind, ...] | None = None
    """Which layers are local and which full, as a pattern repeated over the layers (Gemma 3:
    [local, local, local, local, local, full]; Gemma 2: [local, full]); null: every layer local
    (a window on every layer). Without a sliding_window every layer is full, whatever this says (so
    `sliding_window: null` beside init_from turns a checkpoint's window off)."""
    local_rope_theta: float | None = Field(None, gt=0)
    """The RoPE base of the local layers, without scaling (Gemma 3: 10,000, its global layers
    at rope_theta with rope_scaling); null: local layers rotate as the full ones."""
    query_pre_attn_scalar: float | None = Field(None, gt=0)
    """Attention scores are scaled by query_pre_attn_scalar^-1/2 (Gemma: 256, or hidden / heads
    in Gemma 2 27B); null: head_dim^-1/2."""
    attention_softcap: float | None = Field(None, gt=0)
    """Attention scores soft-capped in every layer, cap * tanh(score / cap), before the softmax
    (Gemma 2: 50); null: none."""
    logit_softcap: float | None = Field(None, gt=0)
    """Output logits soft-capped the same way before the loss (Gemma 2: 30); null: none."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"preset": data}
        if isinstance(data, dict) and "head_dim" in data and data["head_dim"] is None:
            # head_dim: null means what omitting it means: hidden / heads.
            data = {k: v for k, v in data.items() if k != "head_dim"}
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if not isinstance(name, str) or name not in MODEL_PRESETS:
                raise PydanticCustomError(
                    "preset",
                    "{message}",
                    {
                        "message": (
                            f"unknown model preset {name!r}; known presets: "
                            + ", ".join(sorted(MODEL_PRESETS))
                        )
                    },
                )
            preset = MODEL_PRESETS[name]
            merged = {**preset, **data}
            if isinstance(preset.get("moe"), dict) and isinstance(data.get("moe"), dict):
                # moe fields given beside a preset change those fields, not the whole section.
                merged["moe"] = {**preset["moe"], **data["moe"]}
            data = merged
        return data

    @model_validator(mode="before")
    @classmethod
    def _apply_init_from(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("init_from") is None:
            return data
        directory = str(data["init_from"])
        where = str(Path(directory) / CONFIG_FILE)
        hub_id = hub_id_error(directory)
        if hub_id is not None:
            raise PydanticCustomError("init_from", "{message}", {"message": hub_id})
        if data.get("preset") is not None:
            raise PydanticCustomError(
                "init_from",
                "{message}",
                {
                    "message": (
                        f"give model.preset or model.init_from, not both (init_from {directory!r} "
                        "fixes the shape)"
                    )
                },
            )
        required = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")
        if not (Path(directory) / CONFIG_FILE).exists() and all(
            data.get(name) is not None for name in required
        ):
            # Not here (a login node renders a job whose checkpoint lives on the cluster): the
            # spec's own shape stands here; validation warns, and the trainer, where the
            # directory is, validates again against its config.json.
            return data
        try:
            fields = model_fields(directory)
        except HFConfigError as exc:
            raise PydanticCustomError("init_from", "{message}", {"message": str(exc)}) from None
        for name in SHAPE_FIELDS:
            given = data.get(name)
            if given is not None and given != fields[name]:
                raise PydanticCustomError(
                    "init_from",
                    "{message}",
                    {
                        "message": (
                            f"model.{name} = {given!r} disagrees with {fields[name]!r} in {where} "
                            f"(model.init_from); fix: remove model.{name} or make it agree"
                        )
                    },
                )
        given_moe, moe = data.get("moe"), fields.get("moe")
        if isinstance(given_moe, dict) and isinstance(moe, dict):
            for name, value in given_moe.items():
                if name not in MOE_TRAINING_FIELDS and moe.get(name) != value:
                    raise PydanticCustomError(
                        "init_from",
                        "{message}",
                        {
                            "message": (
                                f"model.moe.{name} = {value!r} disagrees with {moe.get(name)!r} "
                                f"in {where} (model.init_from); fix: remove model.moe.{name} "
                                "or make it agree"
                            )
                        },
                    )
            data = {**data, "moe": {**moe, **given_moe}}
        # rope_theta and rope_scaling in the spec win: that is how a context is extended.
        return {**fields, **data}

    @model_validator(mode="after")
    def _check_shape(self) -> ModelSpec:
        problems = []
        head_dim: int | None = self.head_dim
        if head_dim is None:
            if self.hidden % self.heads:
                problems.append(
                    _problem(
                        ("hidden",),
                        self.hidden,
                        f"hidden = {self.hidden} must be divisible by heads = {self.heads} "
                        "(head_dim = hidden / heads when head_dim is not given); fix: change "
                        "hidden or heads, or give head_dim",
                    )
                )
            else:
                head_dim = self.hidden // self.heads
                # Frozen: filled in once, here, so every reader sees the width.
                object.__setattr__(self, "head_dim", head_dim)
        if self.heads % self.kv_heads:
            problems.append(
                _problem(
                    ("kv_heads",),
                    self.kv_heads,
                    f"heads = {self.heads} must be divisible by kv_heads = {self.kv_heads} "
                    "(each K/V head serves a whole group of query heads); fix: pick kv_heads that "
                    "divides heads",
                )
            )
        if head_dim is not None and head_dim % 2:
            problems.append(
                _problem(
                    ("head_dim",),
                    head_dim,
                    f"head_dim = {head_dim} must be even for RoPE (it rotates pairs); fix: "
                    "change head_dim (or hidden or heads)",
                )
            )
        problems += self._moe_problems()
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self

    def _moe_problems(self) -> list:
        """The family's block and the `moe` section agree: a mixture of experts where the
        family has one, with a shared expert where it has one, a router that renormalises
        where the family's always does, and at least one sparse layer."""
        family = FAMILIES[self.family]
        moe = self.moe
        if family.experts is None:
            if moe is None:
                return []
            return [
                _problem(
                    ("moe",),
                    "moe",
                    f"the {family.name} family's block is dense; fix: remove model.moe, or pick "
                    "a family with experts ("
                    + ", ".join(f.name for f in FAMILIES.values() if f.experts is not None)
                    + ")",
                )
            ]
        if moe is None:
            return [
                _problem(
                    ("moe",),
                    None,
                    f"the {family.name} family's feed-forward is a mixture of experts: model.moe "
                    "needs experts, experts_per_token and ffn_hidden (a preset or init_from "
                    "sets them)",
                )
            ]
        problems = []
        if family.shared_expert != (moe.shared_ffn_hidden is not None):
            problems.append(
                _problem(
                    ("moe", "shared_ffn_hidden"),
                    moe.shared_ffn_hidden,
                    f"the {family.name} family "
                    + (
                        "has a shared expert: give its width"
                        if family.shared_expert
                        else "has no shared expert: leave it null"
                    ),
                )
            )
        if family.clamped_swiglu != (moe.swiglu_limit is not None):
            problems.append(
                _problem(
                    ("moe", "swiglu_limit"),
                    moe.swiglu_limit,
                    f"the {family.name} family's experts "
                    + (
                        "use the clamped SwiGLU: give its limit"
                        if family.clamped_swiglu
                        else "use the plain SwiGLU: leave it null"
                    ),
                )
            )
        if family.router_renormalises and not moe.norm_topk_prob:
            problems.append(
                _problem(
                    ("moe", "norm_topk_prob"),
                    False,
                    f"the {family.name} family's router always renormalises the top-k "
                    "probabilities; fix: norm_topk_prob: true",
                )
            )
        shaped = family.moe_problem(self)
        if shaped is not None:
            problems.append(_problem(("moe",), "moe", shaped))
        outside = [i for i in moe.dense_layers if i >= self.layers]
        if outside:
            problems.append(
                _problem(
                    ("moe", "dense_layers"),
                    outside,
                    f"dense_layers {outside} are not layers of a {self.layers}-layer model",
                )
            )
        if not moe.moe_layers(self.layers):
            problems.append(
                _problem(
                    ("moe", "layer_step"),
                    moe.layer_step,
                    "no layer is a mixture of experts with this layer_step and dense_layers",
                )
            )
        return problems

    @model_validator(mode="after")
    def _check_layer_types(self) -> ModelSpec:
        problems = []
        if self.layer_types is not None and not self.layer_types:
            problems.append(
                _problem(
                    ("layer_types",),
                    list(self.layer_types),
                    "layer_types is empty; fix: list a pattern of full and local layers, or null",
                )
            )
        elif self.layer_types is not None and len(self.layer_types) > self.layers:
            problems.append(
                _problem(
                    ("layer_types",),
                    list(self.layer_types),
                    f"layer_types lists {len(self.layer_types)} layers, more than layers = "
                    f"{self.layers}; fix: give a pattern of at most {self.layers} entries",
                )
            )
        if (
            self.local_rope_theta is not None
            and self.sliding_window is not None
            and not any(self.layer_windows)
        ):
            problems.append(
                _problem(
                    ("local_rope_theta",),
                    self.local_rope_theta,
                    "local_rope_theta is set but no layer is local; fix: set sliding_window "
                    "(and layer_types), or local_rope_theta: null",
                )
            )
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self

    @model_validator(mode="after")
    def _check_weights(self) -> ModelSpec:
        # Before any rank starts: the weights' headers against the shape (config.json's, or the
        # spec's where they agree). A directory not here, or holding config.json alone, is left
        # to the trainer, which refuses it by name where it runs.
        if self.init_from is None or not has_weights(self.init_from):
            return self
        try:
            check_weights(self.init_from, self, FAMILIES[self.family])
        except HFWeightsError as exc:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [_problem(("init_from",), self.init_from, str(exc))],
            ) from None
        return self

    @property
    def q_hidden(self) -> int:
        """Width of Q (and of the attention output): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """The family puts biases on the q, k and v projections."""
        return FAMILIES[self.family].qkv_bias

    @property
    def o_bias(self) -> bool:
        """The family puts a bias on the attention's output projection too."""
        return FAMILIES[self.family].o_bias

    @property
    def qk_norm(self) -> bool:
        """The family normalises each head of q and of k before RoPE."""
        return FAMILIES[self.family].qk_norm

    @property
    def norm_offset(self) -> bool:
        """The family's RMSNorm gains are stored as w and applied as 1 + w."""
        return FAMILIES[self.family].norm_offset

    @property
    def post_norms(self) -> bool:
        """The family normalises each sub-block's output too, before the residual add."""
        return FAMILIES[self.family].post_norms

    @property
    def activation(self) -> str:
        """The feed-forward gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)."""
        return FAMILIES[self.family].activation

    @property
    def embedding_scale(self) -> bool:
        """The family multiplies the embedding by sqrt(hidden)."""
        return FAMILIES[self.family].embedding_scale

    @property
    def attention_sinks(self) -> bool:
        """The family's attention has a learned sink logit per query head."""
        return FAMILIES[self.family].attention_sinks

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its window: sliding_window for a local layer, None for a full one."""
        if self.sliding_window is None:
            return (None,) * self.layers
        pattern = self.layer_types or ("local",)
        return tuple(
            self.sliding_window if pattern[i % len(pattern)] == "local" else None
            for i in range(self.layers)
        )

    @property
    def local_layers(self) -> int:
        """How many layers are local."""
        return sum(w is not None for w in self.layer_windows)

    @property
    def shared_expert(self) -> bool:
        """The family's mixture-of-experts blocks have a shared expert behind a sigmoid
        gate."""
        return FAMILIES[self.family].shared_expert

    @property
    def expert_biases(self) -> bool:
        """The family's routers and experts have biases."""
        return FAMILIES[self.family].expert_biases

    @property
    def router_top_k_first(self) -> bool:
        """The family's router softmaxes over the top-k logits alone."""
        return FAMILIES[self.family].router_top_k_first
