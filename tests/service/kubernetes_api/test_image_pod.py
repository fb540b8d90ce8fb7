"""`ctxlaunch image check --via pod` on the real API server, where no kubelet runs: the check
must end within its timeout, say why, and delete its pod."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.helpers.kube_api import kubectl
from tests.helpers.paths import JOBS
from tests.helpers.services import KUBE_ADMIN, require_kubernetes

BIN = Path(sys.executable).parent
CTXLAUNCH = str(BIN / "ctxlaunch")
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_the_probe_pod_ends_in_time_says_why_and_is_deleted(tmp_path: Path) -> None:
    """On the real API server (no scheduler or kubelet): the pod is created with the job's
    image and pull policy, stays Pending, and the check gives up at its timeout and deletes
    it."""
    require_kubernetes()
    namespace = f"ctxl-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", namespace)
    # The `default` service account a controller manager would create (none runs here).
    kubectl("create", "serviceaccount", "default", "-n", namespace)
    result = subprocess.run(
        [
            CTXLAUNCH,
            "image",
            "check",
            str(JOBS / "demo.yaml"),
            "--via",
            "pod",
            "--timeout",
            "3",
            "--set",
            "cluster.kubernetes.image=example/ctxlaunch:1",
            "--set",
            f"cluster.kubernetes.namespace={namespace}",
        ],
        env={**ENV, "KUBECONFIG": str(KUBE_ADMIN)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the pod is still Pending after 3 s" in result.stdout
    assert "is a scheduler and a kubelet running?" in result.stdout
    assert (
        "cannot start the trainer" in result.stderr
        and f"pod {namespace}/demo-image-check-" in result.stderr
    )
    left = kubectl("get", "pods", "-n", namespace, "-o", "name").stdout.split()
    assert left == [] or all(
        kubectl("get", p, "-n", namespace, "-o", "jsonpath={.metadata.deletionTimestamp}").stdout
        for p in left
    )
