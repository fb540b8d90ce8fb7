"""`ctxlaunch calibrate SPEC --submit` on target kubernetes: the spec's own PyTorchJob, rendered
through the same template with the calibration job as the pods' entry, created on the real kube-apiserver running here
(scripts/services/kubernetes.sh). No kubelet runs on that server, so the pods never start:
this test checks what is created; tests/service/kubernetes_node/test_kubernetes_node.py runs the job on a real node
and brings its profile back (--wait)."""

from __future__ import annotations

import pytest

from tests.helpers.kube_api import ctx, get, kubectl, spec_args
from tests.helpers.services import require_kubernetes


@pytest.fixture(scope="module", autouse=True)
def kube() -> None:
    require_kubernetes()  # before the namespace fixture talks to the server


@pytest.mark.timeout(120)
def test_calibration_job_is_created_on_the_api_server(namespace: str, home) -> None:
    result = ctx(home, "calibrate", "--submit", *spec_args(namespace, "calib"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"{namespace}/calib", result.stdout
    job = get("pytorchjobs", namespace, "calib")
    assert job is not None
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master"}  # one node
    (container,) = specs["Master"]["template"]["spec"]["containers"]
    # One process per pod, the calibration itself (not the trainer's torchrun); a pod shares no
    # filesystem with the submitter, so the profile comes back through its log.
    assert container["command"] == [
        "python3",
        "-m",
        "ctxlaunch.runtime.calibration.job",
        "/etc/ctxlaunch/spec.json",
    ]
    assert job["spec"]["nprocPerNode"] == "1"
    kubectl("delete", "pytorchjobs,configmaps", "--all", "-n", namespace)
    kubectl("delete", "namespace", namespace, "--wait=false")
