"""Shared fixtures: example specs, golden files, the PyTorchJob CRD."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
GOLDEN = Path(__file__).resolve().parent / "golden"
DEFAULT_CRD = ROOT.parent / "shared" / "crds" / "kubeflow.org_pytorchjobs.yaml"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true",
                     help="Rewrite golden files from the current output instead of comparing.")


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


@pytest.fixture
def check_golden(update_goldens: bool):
    """Compare text with a golden file (or rewrite it under --update-goldens)."""

    def check(relative: str, actual: str) -> None:
        path = GOLDEN / relative
        if update_goldens:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(actual, encoding="utf-8")
            return
        assert path.exists(), f"missing golden {path}; run pytest --update-goldens and review it"
        expected = path.read_text(encoding="utf-8")
        assert actual == expected, (
            f"{relative} differs from its golden file; if the change is intended, run "
            "pytest --update-goldens and review the diff")

    return check


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def crd_path() -> Path | None:
    path = Path(os.environ.get("CTXLAUNCH_PYTORCHJOB_CRD", DEFAULT_CRD))
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def pytorchjob_crd() -> Path:
    path = crd_path()
    if path is None:
        pytest.skip("the PyTorchJob CRD is absent: set CTXLAUNCH_PYTORCHJOB_CRD or provide "
                    f"{DEFAULT_CRD}")
    return path



TRAINER_CRDS = {kind: ROOT.parent / "shared" / "crds" / f"trainer.kubeflow.org_{plural}.yaml"
                for kind, plural in [("TrainJob", "trainjobs"),
                                     ("TrainingRuntime", "trainingruntimes")]}


@pytest.fixture(scope="session")
def trainer_crds() -> dict[str, Path]:
    """Kubeflow Trainer v2.3.0's TrainJob and TrainingRuntime CRDs (../shared/crds)."""
    missing = [str(p) for p in TRAINER_CRDS.values() if not p.is_file()]
    if missing:
        pytest.skip(f"the Trainer v2 CRDs are absent: {', '.join(missing)}")
    return TRAINER_CRDS
