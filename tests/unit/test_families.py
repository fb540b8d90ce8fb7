"""A model family is one place: each family's module under contract/families says what it is,
and the rest of ctxlaunch asks it. What the family describes (every parameter and its shape,
the Hugging Face tensors a checkpoint holds) is what the trainer builds and what the planner
counts, for every family and its presets."""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

from ctxlaunch.contract.families import FAMILIES, MODEL_PRESETS
from ctxlaunch.contract.families.experts import is_expert_parameter
from ctxlaunch.contract.families.family import parameter_shapes
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.flops import count_params
from tests.helpers.paths import ROOT

PACKAGE = ROOT / "ctxlaunch"
COMMON = "llama"
"""The family whose block is the common one: its name is also the word for that block."""


def _tiny(family: str) -> ModelSpec:
    """A tiny model of `family`; with experts where the family has them (every layer sparse
    but the last, so a dense one stands among them where the family allows it), and a shared
    expert where it has one."""
    fields: dict = {
        "family": family,
        "layers": 3,
        "hidden": 64,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "ffn_hidden": 96,
        "vocab": 256,
    }
    spec = FAMILIES[family]
    if spec.experts is not None:
        moe = {
            "experts": 4,
            "experts_per_token": 2,
            "ffn_hidden": 96,
            "norm_topk_prob": spec.router_renormalises,
        }
        if spec.shared_expert:
            moe["shared_ffn_hidden"] = 48
        if spec.clamped_swiglu:
            moe |= {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
        try:  # a dense layer among the sparse ones, where the family's config can say so
            ModelSpec.model_validate({**fields, "moe": {**moe, "dense_layers": [2]}})
            moe["dense_layers"] = [2]
        except ValidationError:
            pass
        fields["moe"] = moe
    return ModelSpec.model_validate(fields)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_trainer_builds_what_the_family_describes(family: str) -> None:
    """Every parameter of the built model, by name and shape, is the family's description of
    it; the planner's parameter count is the same total."""
    from ctxlaunch.runtime.modeling.model import Transformer

    model = _tiny(family)
    with torch.device("meta"):
        built = Transformer.from_spec(model)
    assert {n: tuple(p.shape) for n, p in built.named_parameters()} == parameter_shapes(model)
    described = sum(torch.Size(s).numel() for s in parameter_shapes(model).values())
    assert count_params(model).total == described


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_parameter_has_its_hugging_face_tensors(family: str) -> None:
    """The family's names cover every parameter, each Hugging Face tensor named once, with the
    parts of a fused projection adding up to it (of an experts tensor, to its rows flattened
    over the experts; of a stacked experts tensor, the same elements in one tensor)."""
    model = _tiny(family)
    spec = FAMILIES[family]
    tensors = spec.hf_tensors(model)
    parts_of = {
        name: spec.hf_parts(name, shape, model) for name, shape in parameter_shapes(model).items()
    }
    named = [n for parts in parts_of.values() for n, _ in parts]
    assert len(named) == len(set(named)) == len(tensors)
    stacked = spec.experts is not None and spec.experts.stacked is not None
    for name, shape in parameter_shapes(model).items():
        parts = [tensors[n] for n, _ in parts_of[name]]
        if stacked and is_expert_parameter(name):
            assert len(parts) == 1 and torch.Size(parts[0]).numel() == torch.Size(shape).numel()
            continue
        rows = shape[0] * shape[1] if len(shape) == 3 else shape[0]
        tail = shape[-1:] if len(shape) == 3 else shape[1:]
        assert sum(p[0] for p in parts) == rows and {p[1:] for p in parts} == {tail}


def test_every_preset_validates_in_its_family() -> None:
    """A preset carries its family's name, and its shape is one the spec takes."""
    for name, fields in MODEL_PRESETS.items():
        model = ModelSpec.model_validate({"preset": name})
        assert model.family == fields["family"], name
        assert name in FAMILIES[model.family].presets


def test_no_module_outside_the_families_names_a_family() -> None:
    """Adding a family is its module and its registration: no other module of the package
    names it, by ctxlaunch's name, its model_type or its Hugging Face class."""
    words = {
        word
        for family in FAMILIES.values()
        if family.name != COMMON
        for word in (family.name, family.model_type, family.architecture)
    }
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(words))) + r")\b", re.I)
    found = [
        f"{path.relative_to(PACKAGE)}:{line_no}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "families" not in path.relative_to(PACKAGE).parts
        for line_no, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], "\n".join(found)


def test_the_check_sees_a_family_named_elsewhere() -> None:
    """The pattern above matches a family's name as a word, whatever its case."""
    words = sorted(f.name for f in FAMILIES.values() if f.name != COMMON)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.I)
    assert pattern.search(f"if model.family == '{words[0].upper()}':")
    assert not pattern.search(f"{words[0]}_moe")
