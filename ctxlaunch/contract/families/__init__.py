"""The decoder families ctxlaunch trains, one module each, and the ones transformers knows that
it refuses (`refused`).

A family is one `Family` (`family.py`): its Hugging Face class and model_type, the parts its
block adds to the common one (q/k/v biases, q/k norms, norms with a unit offset and after each
sub-block, GeGLU, a scaled embedding, attention sinks, a mixture-of-experts feed-forward, its
shared expert and its biases: `experts.py`), how its config.json states its local (sliding-window) layers and
their RoPE, the config keys its export writes, and its presets. Everything else in ctxlaunch
reads these through `FAMILIES` and never names a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from ctxlaunch.contract.families import (
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from ctxlaunch.contract.families.family import Family
from ctxlaunch.contract.families.refused import REFUSED

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        llama.FAMILY,
        mistral.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        gemma2.FAMILY,
        gemma3.FAMILY,
        qwen3_moe.FAMILY,
        mixtral.FAMILY,
        qwen2_moe.FAMILY,
        gpt_oss.FAMILY,
    )
}
"""The families `model.family` takes, by name."""

if TYPE_CHECKING:
    FamilyName = str
else:
    FamilyName = Literal[tuple(FAMILIES)]
"""A family's name, as the spec's `model.family` takes it (the registry's names)."""

MODEL_PRESETS: dict[str, Mapping[str, Any]] = {
    name: {"family": family.name, **fields}
    for family in FAMILIES.values()
    for name, fields in family.presets.items()
}
"""Every family's named shapes: a spec's `model: {preset: NAME}` starts from one of these;
any field written beside the preset overrides it."""

__all__ = [
    "FAMILIES",
    "MODEL_PRESETS",
    "REFUSED",
    "Family",
    "FamilyName",
    "family_of_architecture",
    "family_of_model_type",
    "supported_architectures",
]


def family_of_architecture(architecture: str) -> Family | None:
    """The family whose checkpoints are of transformers class `architecture` (or hold its
    decoder as their text model), if any."""
    return next(
        (f for f in FAMILIES.values() if architecture in (f.architecture, *f.wrappers)), None
    )


def family_of_model_type(model_type: str) -> Family | None:
    """The family whose config.json has `model_type`, if any."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


def supported_architectures() -> str:
    """The classes `model.init_from` takes, for messages: the class names only, so the
    sentence stays within what an error shows however many families there are."""
    return ", ".join(name for f in FAMILIES.values() for name in (f.architecture, *f.wrappers))
