"""Fixtures the modules against the real kube-apiserver share: `namespace` (a fresh one per
test) and `home` (each test's own CTXLAUNCH_HOME)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.helpers.kube_api import kubectl


@pytest.fixture
def namespace() -> str:
    """A fresh namespace, with the `default` service account that a controller manager would
    create (none runs here; the pods the tests create need it)."""
    name = f"ctxl-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    kubectl("create", "serviceaccount", "default", "-n", name)
    return name


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"
