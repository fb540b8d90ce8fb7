"""What the tests against the real kube-apiserver (scripts/services/kubernetes.sh) share: kubectl
and ctxlaunch run against it, the demo spec aimed at it, and pods played as the kubelet would
leave them (no kubelet runs on that server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import JOBS
from tests.helpers.services import KUBE_ADMIN

BIN = Path(sys.executable).parent
CTXLAUNCH = str(BIN / "ctxlaunch")
KUBECTL = str(BIN / "kubectl")
IMAGE = "example/ctxlaunch:1"


def kubectl(
    *args: str, kubeconfig: Path = KUBE_ADMIN, check: bool = True, stdin: str = ""
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [KUBECTL, "--kubeconfig", str(kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result


def ctx(
    home: Path, *args: str, kubeconfig: Path = KUBE_ADMIN, timeout: float = 60
) -> subprocess.CompletedProcess:
    env = {**os.environ, "CTXLAUNCH_HOME": str(home), "KUBECONFIG": str(kubeconfig)}
    return subprocess.run(
        [CTXLAUNCH, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def spec_args(namespace: str, name: str = "demo", *sets: str) -> list[str]:
    args = [str(JOBS / "demo.yaml")]
    for item in (
        "cluster.target=kubernetes",
        f"cluster.kubernetes.image={IMAGE}",
        f"cluster.kubernetes.namespace={namespace}",
        f"name={name}",
        *sets,
    ):
        args += ["--set", item]
    return args


def get(kind: str, namespace: str, name: str) -> dict | None:
    result = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        assert "NotFound" in result.stderr, result.stderr
        return None
    return json.loads(result.stdout)


def status(home: Path, job: str) -> dict:
    result = ctx(home, "status", job, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def contains(actual, expected, where: str = "") -> None:
    """Every field of `expected` is in `actual` with the same value (the server may add its
    defaults, nothing else changes)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} missing on the server"
            contains(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            contains(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: server has {actual!r}, rendered {expected!r}"


def render_dir(tmp_path: Path, spec: Path, namespace: str, *sets: str) -> Path:
    out = tmp_path / "rendered"
    args = [
        CTXLAUNCH,
        "render",
        str(spec),
        "--target",
        "kubernetes",
        "--output",
        str(out),
        "--set",
        f"cluster.kubernetes.namespace={namespace}",
    ]
    for item in sets:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return out


def play_pod(
    namespace: str,
    name: str,
    labels: dict[str, str],
    container: str,
    *,
    exit_code: int | None = None,
    reason: str = "Error",
    node: str | None = None,
) -> str:
    """Play the controller that creates a job's pod and the kubelet that runs it: a pod with
    the controller's `labels` whose trainer `container` runs, or, given `exit_code`, ended
    with it (the pod's status subresource, as the kubelet writes it); its uid."""
    spec: dict = {
        "automountServiceAccountToken": False,
        "restartPolicy": "Never",
        "containers": [{"name": container, "image": IMAGE}],
    }
    if node is not None:
        spec["nodeName"] = node
    kubectl(
        "create",
        "-f",
        "-",
        stdin=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": labels},
                "spec": spec,
            }
        ),
    )
    if exit_code is None:
        phase, ready = "Running", True
        state: dict = {"running": {"startedAt": "2026-12-01T00:00:00Z"}}
    else:
        phase, ready = "Failed", False
        state = {
            "terminated": {
                "exitCode": exit_code,
                "reason": reason,
                "startedAt": "2026-12-01T00:00:00Z",
                "finishedAt": "2026-12-01T00:00:05Z",
            }
        }
    kubectl(
        "patch",
        "pod",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(
            {
                "status": {
                    "phase": phase,
                    "containerStatuses": [
                        {
                            "name": container,
                            "image": IMAGE,
                            "imageID": "",
                            "ready": ready,
                            "restartCount": 0,
                            "state": state,
                        }
                    ],
                }
            }
        ),
    )
    pod = get("pod", namespace, name)
    assert pod is not None
    return pod["metadata"]["uid"]
