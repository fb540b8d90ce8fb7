"""What rank 0 writes into its TrainJob's status, against Trainer v2.3.0's own schema of
status.trainerStatus, and what the rendered TrainJob grants it (the same against the real API
server: tests/service/kubernetes_api/test_trainjob_status.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from ctxlaunch.contract.loader import load_spec
from ctxlaunch.launch.render import render_files
from ctxlaunch.runtime.records import StepMetrics
from ctxlaunch.runtime.telemetry.trainjob_status import trainer_status
from tests.helpers.paths import JOBS


def _metrics(step: int, steps: int, remaining: float | None) -> StepMetrics:
    return StepMetrics(
        step=step,
        loss=3.14159265,
        step_seconds=12.5,
        tokens_per_second_per_gpu=2948.123,
        model_tflops_per_gpu_full=420.0,
        model_tflops_per_gpu_causal=380.0,
        peak_memory_bytes=70 << 30,
        lr=1e-5,
        grad_norm=0.5,
        exposed_comm_seconds=0.1,
        steps=steps,
        progress=step / steps,
        remaining_seconds=remaining,
        predicted_step_seconds=12.0,
    )


@pytest.fixture
def trainer_status_schema(trainer_crds: dict) -> dict:
    """status.trainerStatus of the v2.3.0 TrainJob CRD, unknown fields refused."""
    from tests.helpers.crd import strict_json_schema

    crd = yaml.safe_load(trainer_crds["TrainJob"].read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return strict_json_schema(root["properties"]["status"]["properties"]["trainerStatus"])


def test_the_status_fits_the_crds_schema(trainer_status_schema: dict) -> None:
    import jsonschema

    validator = jsonschema.Draft7Validator(trainer_status_schema)
    for status in (
        trainer_status(_metrics(30, 100, 875.4), now=0.0),
        trainer_status(_metrics(100, 100, 0.0), now=0.0, done=True),
        trainer_status(_metrics(1, 100, None), now=0.0),
        trainer_status(_metrics(1, 10**9, 1e12), now=0.0),
    ):
        assert not list(validator.iter_errors(status)), status
    status = trainer_status(_metrics(30, 100, 875.4), now=0.0)
    assert status["progressPercentage"] == 30 and status["estimatedRemainingSeconds"] == 875
    assert status["lastUpdatedTime"] == "1970-01-01T00:00:00Z"
    assert {m["name"]: m["value"] for m in status["metrics"]}["loss"] == "3.14159"
    # 100 % only when the run is done; before its last step is written it is 99 at most.
    assert trainer_status(_metrics(100, 100, 0.0), now=0.0)["progressPercentage"] == 99
    assert "estimatedRemainingSeconds" not in trainer_status(_metrics(1, 100, None), now=0.0)


def _docs(*sets: str) -> list[dict]:
    spec = load_spec(
        JOBS / "demo.yaml", ["cluster.target=kubernetes", "cluster.kubernetes.image=x:1", *sets]
    )
    (text,) = render_files(spec, "kubernetes").values()
    return [d for d in yaml.safe_load_all(text) if d]


def test_the_role_allows_that_one_status_and_the_token_is_the_trainers_alone() -> None:
    docs = _docs("cluster.kubernetes.api=trainjob")
    kinds = {d["kind"]: d for d in docs}
    assert list(kinds) == [
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "TrainingRuntime",
        "TrainJob",
    ]
    assert kinds["Role"]["rules"] == [
        {
            "apiGroups": ["trainer.kubeflow.org"],
            "resources": ["trainjobs/status"],
            "resourceNames": ["demo"],
            "verbs": ["get", "patch"],
        }
    ]
    assert kinds["ServiceAccount"]["automountServiceAccountToken"] is False
    assert kinds["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-status", "namespace": "default"}
    ]
    (node,) = kinds["TrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-status"
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert {"name": "CTXLAUNCH_TRAINJOB", "value": "default/demo"} in container["env"]
    mounts = [m["name"] for m in container["volumeMounts"]]
    assert mounts.count("trainjob-status") == 1
    # Off: no RBAC, no token, no variable; a PyTorchJob never has them.
    for sets in (
        ("cluster.kubernetes.api=trainjob", "cluster.kubernetes.trainer_status=false"),
        ("cluster.kubernetes.api=pytorchjob",),
    ):
        text = json.dumps(_docs(*sets))
        assert "trainjob-status" not in text and "CTXLAUNCH_TRAINJOB" not in text
        assert '"Role"' not in text
    # A service account of the user's own is bound, not made.
    kinds = [
        d["kind"]
        for d in _docs(
            "cluster.kubernetes.api=trainjob", "cluster.kubernetes.service_account=trainer"
        )
    ]
    assert "ServiceAccount" not in kinds and "RoleBinding" in kinds
