"""Fixtures the Slurm test modules share: `slurm` (skips the module where the cluster is not
running; the modules that need it use it for every test) and `home` (each test's own
CTXLAUNCH_HOME)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.services import require_slurm


@pytest.fixture(scope="module")
def slurm() -> None:
    require_slurm()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"
