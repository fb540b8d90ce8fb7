"""The real services the tests talk to, started by scripts/services/all.sh (scripts/test does
it). A test that needs one fails, with the command to run, when it is not up: nothing here is
skipped silently."""

from __future__ import annotations

import json
import os
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from devkit import SERVICES_DIR

PROMETHEUS_URL = f"http://127.0.0.1:{os.environ.get('CTXLAUNCH_PROMETHEUS_PORT', '9090')}"
PUSHGATEWAY_URL = f"http://127.0.0.1:{os.environ.get('CTXLAUNCH_PUSHGATEWAY_PORT', '9091')}"
TARGETS_DIR = SERVICES_DIR / "prometheus" / "targets"
RULES_DIR = SERVICES_DIR / "prometheus" / "rules"
START_HINT = "start the services with `scripts/services/all.sh start` (scripts/test does it)"
SERVICES_ENV = "CTXLAUNCH_SERVICES"
"""scripts/test exports it as 1 once the services are installed and started: then what they
bring (promtool) must be there, and a test that would skip without it fails instead."""


def services_installed() -> bool:
    """Whether this run is one where the services are installed (SERVICES_ENV is 1)."""
    return os.environ.get(SERVICES_ENV) == "1"


def _get(url: str, timeout: float = 5.0) -> bytes:
    request = urllib.request.Request(url)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        return response.read()


def require_prometheus() -> None:
    for url in (PROMETHEUS_URL, PUSHGATEWAY_URL):
        try:
            _get(url + "/-/ready")
        except OSError as exc:
            pytest.fail(f"{url} is not up ({exc}); {START_HINT}")


def query(expr: str) -> list[dict]:
    """Instant query against the real Prometheus; the result vector."""
    url = PROMETHEUS_URL + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(_get(url))
    assert body["status"] == "success", body
    return body["data"]["result"]


def poll(expr: str, predicate=lambda result: bool(result), timeout: float = 30.0) -> list[dict]:
    """Query until `predicate(result)` holds: new targets and pushes show up within seconds,
    never instantly."""
    deadline = time.monotonic() + timeout
    result: list[dict] = []
    while time.monotonic() < deadline:
        result = query(expr)
        if predicate(result):
            return result
        time.sleep(0.5)
    raise AssertionError(
        f"{expr!r} did not satisfy the check within {timeout:.0f} s; last result: {result}"
    )


def add_scrape_targets(name: str, targets: list[str]) -> Path:
    TARGETS_DIR.mkdir(parents=True, exist_ok=True)
    path = TARGETS_DIR / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": targets, "labels": {}}]))
    tmp.rename(path)
    return path


def require_slurm() -> None:
    import subprocess

    result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        pytest.fail(f"Slurm is not up ({result.stderr.strip() or 'no nodes'}); {START_HINT}")


KUBE_DIR = SERVICES_DIR / "kubernetes"
KUBE_ADMIN = KUBE_DIR / "admin.kubeconfig"
KUBE_VIEWER = KUBE_DIR / "viewer.kubeconfig"
KUBE_CRD = KUBE_DIR / "pytorchjobs-crd.yaml"
"""The CRD as kubernetes.sh installed it (its x-kubernetes-validations key stripped)."""


def require_kubernetes() -> None:
    """Fail, saying how to start it, when the API server is not up; skip, saying why, only
    where the PyTorchJob CRD it would serve is absent (../shared, or
    $CTXLAUNCH_PYTORCHJOB_CRD), as kubernetes.sh then starts nothing."""
    import subprocess
    import sys

    from tests.helpers.crd import crd_path

    if crd_path() is None:
        pytest.skip(
            "the PyTorchJob CRD is absent (set CTXLAUNCH_PYTORCHJOB_CRD or provide "
            "../shared/crds/kubeflow.org_pytorchjobs.yaml): no Kubernetes API server "
            "was started"
        )
    kubectl = Path(sys.executable).parent / "kubectl"
    if not KUBE_ADMIN.is_file():
        pytest.fail(f"no {KUBE_ADMIN}: the Kubernetes API server is not up; {START_HINT}")
    result = subprocess.run(
        [str(kubectl), "--kubeconfig", str(KUBE_ADMIN), "get", "--raw", "/readyz"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0 or result.stdout.strip() != "ok":
        pytest.fail(
            f"the Kubernetes API server is not ready "
            f"({(result.stderr or result.stdout).strip()}); {START_HINT}"
        )
