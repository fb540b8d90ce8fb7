"""Turn a CRD's openAPIV3Schema into a JSON Schema that forbids unknown fields, as a strict
API server (Kubernetes >= 1.25 with field validation Strict) would."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.paths import ROOT

DEFAULT_CRD = ROOT.parent / "shared" / "crds" / "kubeflow.org_pytorchjobs.yaml"
"""The real PyTorchJob CRD, beside the checkout (../shared/crds)."""


def crd_location() -> Path:
    """Where the PyTorchJob CRD is read: $CTXLAUNCH_PYTORCHJOB_CRD, else ../shared/crds."""
    return Path(os.environ.get("CTXLAUNCH_PYTORCHJOB_CRD", DEFAULT_CRD))


def crd_path() -> Path | None:
    """The PyTorchJob CRD's file, or None where it is absent."""
    path = crd_location()
    return path if path.is_file() else None


def strict_json_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [strict_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: strict_json_schema(value)
        for key, value in node.items()
        if not key.startswith("x-kubernetes-")
    }
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if (
        node.get("type") == "object"
        and "properties" in node
        and not preserve
        and "additionalProperties" not in node
    ):
        out["additionalProperties"] = False
    return out


def pytorchjob_schema(crd_path: Path, version: str = "v1") -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text())
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return strict_json_schema(entry["schema"]["openAPIV3Schema"])
    raise KeyError(f"{crd_path} has no version {version}")
