"""Shared fixtures (example specs' golden files, the real CRDs) and the suite's layout.

tests/unit needs no service and no root: pure Python and CPU torch, multi-process gloo runs
included (marked `distributed`: they take minutes; `-m "not distributed"` leaves them out).
tests/service/<group> talks to a real service that scripts/test starts (Slurm with Prometheus,
the Kubernetes API server, the single-node Kubernetes cluster); each group's tests share that
service, so under pytest-xdist they run on one worker, in order. A module or test that shares
nothing with the rest of its folder names its own group (`pytest.mark.service_group`): the
Slurm tests on this host's node, those on the namespaced nodes, and the local runs that only
talk to Prometheus run side by side."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.crd import DEFAULT_CRD, crd_location, crd_path
from tests.helpers.paths import GOLDEN


def service_group(path: Path) -> str | None:
    """The service group of the test file at `path`: its folder in tests/service/<group>/."""
    parts = path.parts
    for index in range(len(parts) - 3):
        if parts[index : index + 2] == ("tests", "service"):
            return parts[index + 2]
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: xdist's worker reads the xdist_group markers in its own
    # pytest_collection_modifyitems (into each node id's "@group" suffix, which its loadgroup
    # scheduler goes by), so the markers must be there before it runs.
    for item in items:
        group = service_group(item.path)
        named = item.get_closest_marker("service_group")
        if group is not None and named is not None:
            group = named.args[0]
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
