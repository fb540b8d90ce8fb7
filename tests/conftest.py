"""Shared fixtures: example specs, golden files, the PyTorchJob CRD."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
GOLDEN = Path(__file__).resolve().parent / "golden"
DEFAULT_CRD = ROOT.parent / "shared" / "crds" / "kubeflow.org_pytorchjobs.yaml"


SERVICE_GROUPS: dict[str, tuple[str, ...]] = {
    # The shared Slurm cluster (whose nodes the fault tests drain, kill and fill) and the
    # Prometheus + Pushgateway its jobs and the live telemetry tests push to and reload.
    "slurm-prometheus": (
        "test_slurm.py",
        "test_slurm_faults.py",
        "test_calibrate_slurm.py",
        "test_telemetry_live.py",
    ),
    # The single-node cluster's node: its pods share the node's memory and the project image.
    "kubernetes-node": ("test_kubernetes_node.py",),
    # The API server at 127.0.0.1:6443 (each test has its own namespace; one worker still,
    # so that its tests' polling never races another's cleanup).
    "kubernetes-api": (
        "test_kubernetes.py",
        "test_trainjob.py",
        "test_kuberest.py",
        "test_image.py",
        "test_calibrate_kubernetes.py",
        "test_kube_follow.py",
    ),
}
"""Test files that share a real service, by group: with pytest-xdist (`scripts/test` runs two
workers, --dist loadgroup) each group's tests run on one worker, in file order; every other
test goes to whichever worker is free."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: xdist's worker reads the xdist_group markers in its own
    # pytest_collection_modifyitems (into each node id's "@group" suffix, which its loadgroup
    # scheduler goes by), so the markers must be there before it runs.
    groups = {name: group for group, names in SERVICE_GROUPS.items() for name in names}
    for item in items:
        group = groups.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="Rewrite golden files from the current output instead of comparing.",
    )


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
            "pytest --update-goldens and review the diff"
        )

    return check


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def crd_location() -> Path:
    """Where the PyTorchJob CRD is read: $CTXLAUNCH_PYTORCHJOB_CRD, else ../shared/crds."""
    return Path(os.environ.get("CTXLAUNCH_PYTORCHJOB_CRD", DEFAULT_CRD))


def crd_path() -> Path | None:
    path = crd_location()
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def pytorchjob_crd() -> Path:
    path = crd_path()
    if path is None:
        pytest.skip(
            f"the PyTorchJob CRD is absent: set CTXLAUNCH_PYTORCHJOB_CRD or provide {DEFAULT_CRD}"
        )
    return path


@pytest.fixture(scope="session")
def trainer_crds() -> dict[str, Path]:
    """Kubeflow Trainer v2.3.0's TrainJob and TrainingRuntime CRDs, where kubernetes.sh reads
    them: $CTXLAUNCH_TRAINER_CRDS, else beside the PyTorchJob CRD (../shared/crds)."""
    directory = Path(os.environ.get("CTXLAUNCH_TRAINER_CRDS") or crd_location().parent)
    crds = {
        kind: directory / f"trainer.kubeflow.org_{plural}.yaml"
        for kind, plural in [("TrainJob", "trainjobs"), ("TrainingRuntime", "trainingruntimes")]
    }
    missing = [str(p) for p in crds.values() if not p.is_file()]
    if missing:
        pytest.skip(f"the Trainer v2 CRDs are absent: {', '.join(missing)}")
    return crds
