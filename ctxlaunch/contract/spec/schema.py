"""The job spec's JSON Schema, for editors, with each field described by the docstring under it.

The models are built without pydantic's use_attribute_docstrings, which reads every class's
source while the spec is imported (see `fields._Strict`): the docstrings are read here, from
the modules that define the sections, only when the schema is asked for."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from ctxlaunch.contract.families import MODEL_PRESETS
from ctxlaunch.contract.spec import (
    cluster_section,
    fabric_section,
    fields,
    model_section,
    parallel_section,
    secret_refs,
    telemetry_section,
    trackers_section,
    training_section,
)
from ctxlaunch.contract.spec.fields import _Strict

SECTION_MODULES: tuple[ModuleType, ...] = (
    fields,
    model_section,
    training_section,
    parallel_section,
    secret_refs,
    cluster_section,
    fabric_section,
    trackers_section,
    telemetry_section,
)
"""The modules that define the spec's sections, each after the ones whose models it holds."""


def job_schema(job: type[_Strict]) -> dict[str, Any]:
    """The JSON Schema of the job model `job` (whose module comes after SECTION_MODULES). A
    model is a preset name, a preset with overrides, a Hugging Face checkpoint (init_from) or a
    full shape, so the shape fields are required only without a preset or init_from."""
    _describe_fields((*SECTION_MODULES, sys.modules[job.__module__]))
    schema = job.model_json_schema()
    model = schema["$defs"]["ModelSpec"]
    shape = model.pop("required", [])
    presets = sorted(MODEL_PRESETS)
    model["properties"]["preset"] = {
        "anyOf": [{"enum": presets}, {"type": "null"}],
        "default": None,
        "description": model["properties"]["preset"].get("description", ""),
    }
    model["anyOf"] = [{"required": ["preset"]}, {"required": ["init_from"]}, {"required": shape}]
    schema["properties"]["model"] = {"anyOf": [{"enum": presets}, {"$ref": "#/$defs/ModelSpec"}]}
    return schema


def _field_docstrings(modules: tuple[ModuleType, ...]) -> dict[tuple[str, str], dict[str, str]]:
    """(module, class name) -> field -> the docstring right under the field, as pydantic's
    use_attribute_docstrings reads them (a string statement after an annotated name)."""
    import ast
    import inspect
    import itertools

    found: dict[tuple[str, str], dict[str, str]] = {}
    for module in modules:
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            docs = found.setdefault((module.__name__, node.name), {})
            for field, after in itertools.pairwise(node.body):
                if (
                    isinstance(field, ast.AnnAssign)
                    and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    docs[field.target.id] = inspect.cleandoc(after.value.value)
    return found


def _describe_fields(modules: tuple[ModuleType, ...]) -> None:
    """Give every field of the models that `modules` define a description, its docstring (from
    the class up the MRO that declares it) where it has none, and rebuild the models, the
    nested ones first, so that model_json_schema says them."""
    docs = _field_docstrings(modules)
    models = [
        model
        for module in modules
        for model in vars(module).values()
        if isinstance(model, type)
        and issubclass(model, _Strict)
        and model.__module__ == module.__name__
    ]
    changed = False
    for model in models:
        for name, info in model.model_fields.items():
            owner = next(
                (k for k in model.__mro__ if name in k.__dict__.get("__annotations__", {})), model
            )
            doc = docs.get((owner.__module__, owner.__name__), {}).get(name)
            if info.description is None and doc is not None:
                info.description = doc
                changed = True
    if changed:
        for model in models:  # module by module, each in definition order: the held ones first
            model.model_rebuild(force=True)
