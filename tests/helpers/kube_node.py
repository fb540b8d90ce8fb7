"""Whether a test may run on the single-node Kubernetes cluster (devkit/kube_node.py holds the
cluster's paths and commands, which the benchmarks share)."""

from __future__ import annotations

import os

import pytest

from devkit.kube_node import CACHE_DIR, NODE_ADMIN, START_HINT, kubectl, node_installed


def require_node() -> None:
    """Skip, saying why, where the node is not installed (no kubelet built) or the PyTorchJob CRD
    it would serve is absent (kubernetes.sh then starts nothing, as for the API server alone:
    a kubeconfig left by an earlier start must not read as a node that failed); fail, saying
    how to start it, where it is installed but not up."""
    from tests.helpers.crd import crd_path

    if os.environ.get("CTXLAUNCH_KUBE_NODE_TESTS") == "0":
        pytest.skip("CTXLAUNCH_KUBE_NODE_TESTS=0: the real-node tests are turned off")
    if not node_installed():
        pytest.skip(
            f"the Kubernetes node is not installed (no {CACHE_DIR}/kube-node-*/kubelet): "
            "run `scripts/services/kubernetes.sh install`"
        )
    if crd_path() is None:
        pytest.skip(
            "the PyTorchJob CRD is absent (set CTXLAUNCH_PYTORCHJOB_CRD or provide "
            "../shared/crds/kubeflow.org_pytorchjobs.yaml): the node was not started"
        )
    if not NODE_ADMIN.is_file():
        pytest.fail(f"no {NODE_ADMIN}: the single-node cluster is not up; {START_HINT}")
    result = kubectl(
        "get",
        "node",
        "-o",
        'jsonpath={.items[*].status.conditions[?(@.type=="Ready")].status}',
        check=False,
    )
    if result.returncode != 0 or "True" not in result.stdout.split():
        pytest.fail(
            f"the node is not Ready ({(result.stderr or result.stdout).strip()}); {START_HINT}"
        )
