"""A TrainJob's progress in its status, written by rank 0 against the real kube-apiserver with
Trainer v2.3.0's TrainJob CRD: the RBAC rendered beside the job grants its service account the
TrainJob's status subresource and nothing else, and the writer rank 0 runs, with that account's
own token (a real TokenRequest), fills status.trainerStatus as the CRD defines it.

No kubelet runs on this server, so no pod mounts the token: the test reads the token and the CA
from a directory laid out as the projected volume lays them out, with the service address a pod
is given, which is how the writer finds them in a pod."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ctxlaunch.runtime.records import StepMetrics
from ctxlaunch.runtime.telemetry.trainjob_status import ApiAccess, TrainJobProgress
from tests.helpers.kube_api import ctx, get, kubectl, spec_args
from tests.helpers.services import KUBE_DIR

CRD = "trainjobs.trainer.kubeflow.org"


@pytest.fixture(scope="module", autouse=True)
def trainer_installed() -> None:
    from tests.helpers.services import require_kubernetes

    require_kubernetes()
    if kubectl("get", "crd", CRD, check=False).returncode != 0:
        pytest.fail(f"the API server lacks {CRD}: restart it with scripts/services/kubernetes.sh")


def step(n: int, of: int, remaining: float) -> StepMetrics:
    return StepMetrics(
        step=n,
        loss=5.25,
        step_seconds=2.0,
        tokens_per_second_per_gpu=1234.5,
        model_tflops_per_gpu_full=0.5,
        model_tflops_per_gpu_causal=0.25,
        peak_memory_bytes=1 << 30,
        lr=1e-4,
        grad_norm=1.0,
        exposed_comm_seconds=0.0,
        steps=of,
        progress=n / of,
        remaining_seconds=remaining,
        predicted_step_seconds=1.8,
    )


def trainer_status(namespace: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = (get("trainjob", namespace, "demo") or {}).get("status", {}).get("trainerStatus")
        if found or time.monotonic() > deadline:
            return found or {}
        time.sleep(0.2)


@pytest.mark.timeout(120)
def test_rank_0_writes_trainer_status_with_its_own_least_privilege(
    namespace: str, tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Submitted as ctxlaunch submits it; the writer's progress is what `status` shows while
    the job runs."""
    result = ctx(home, "submit", *spec_args(namespace, "demo", "cluster.kubernetes.api=trainjob"))
    assert result.returncode == 0, result.stdout + result.stderr
    job = result.stdout.strip()
    account = f"system:serviceaccount:{namespace}:demo-status"

    def may(*args: str) -> bool:
        answer = kubectl("auth", "can-i", *args, "-n", namespace, "--as", account, check=False)
        return answer.stdout.strip() == "yes"

    assert may("patch", "trainjobs.trainer.kubeflow.org/demo", "--subresource=status")
    assert not may("patch", "trainjobs.trainer.kubeflow.org/other", "--subresource=status")
    assert not may("patch", "trainjobs.trainer.kubeflow.org/demo")  # the spec stays its own
    assert not may("get", "secrets") and not may("create", "pods")
    assert not may("get", "configmaps")

    # The account's own token, and a directory laid out as the projected volume.
    token = kubectl("create", "token", "demo-status", "-n", namespace).stdout.strip()
    volume = tmp_path / "trainjob-status"
    volume.mkdir()
    (volume / "token").write_text(token)
    (volume / "ca.crt").write_bytes((KUBE_DIR / "pki" / "ca.crt").read_bytes())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    access = ApiAccess.in_pod(str(volume))
    assert access is not None

    said: list[str] = []
    writer = TrainJobProgress(access, namespace, "demo", interval_seconds=0.1, log=said.append)
    writer.on_step(step(3, 10, 14.0))
    status = trainer_status(namespace)
    assert status["progressPercentage"] == 30 and status["estimatedRemainingSeconds"] == 14
    metrics = {m["name"]: m["value"] for m in status["metrics"]}
    assert metrics["loss"] == "5.25" and metrics["step"] == "3" and metrics["steps"] == "10"
    assert metrics["tokens_per_second_per_gpu"] == "1234.5"
    assert metrics["predicted_step_seconds"] == "1.8"
    assert status["lastUpdatedTime"].endswith("Z")
    # `status` while it runs: the progress its rank 0 reported, against the plan.
    shown = json.loads(ctx(home, "status", job, "--json").stdout)["measured"]
    assert (shown["step"], shown["steps"], shown["remaining_seconds"]) == (3, 10, 14.0)
    step_time = next(f for f in shown["figures"] if f["name"] == "step time")
    assert step_time["measured"] == 2.0 and step_time["predicted"] > 0
    writer.on_step(step(10, 10, 0.0))
    writer.close(0)
    status = trainer_status(namespace)
    assert status["progressPercentage"] == 100 and status["estimatedRemainingSeconds"] == 0
    assert said == []  # every write was taken

    # Another job's status is refused to this account, said once, never raised.
    other = TrainJobProgress(access, namespace, "other", interval_seconds=60, log=said.append)
    assert (
        other.write({"progressPercentage": 1, "lastUpdatedTime": "2026-01-01T00:00:00Z"}) is False
    )
    other.close(1)
    assert len(said) == 1 and "cannot write the TrainJob's trainerStatus" in said[0]
    assert "forbidden" in said[0].lower()

    assert ctx(home, "cancel", job).returncode == 0
    left = kubectl(
        "get", "serviceaccounts,roles,rolebindings", "-n", namespace, "-o", "json"
    ).stdout
    assert not [
        item
        for item in json.loads(left)["items"]
        if item["metadata"]["name"].startswith("demo-status")
    ]
