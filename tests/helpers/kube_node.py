"""The single-node Kubernetes cluster of scripts/services/kubernetes.sh with
CTXLAUNCH_KUBE_NODE=1 (its own directory and ports beside the API-server-only one) and the
project image the node tests run, written by scripts/services/ociimage.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.services import SERVICES_DIR

REPO = Path(__file__).resolve().parents[2]
NODE_DIR = SERVICES_DIR / "kubernetes-node"
NODE_ADMIN = NODE_DIR / "admin.kubeconfig"
CONTAINERD_SOCK = NODE_DIR / "run" / "containerd.sock"
CACHE_DIR = Path(os.environ.get("CTXLAUNCH_KUBE_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "ctxlaunch")
NODE_TAINT_KEY = "ctxlaunch.dev/node-tests"
"""The node registers with this NoSchedule taint: only pods that tolerate it run there."""
START_HINT = ("start it with `CTXLAUNCH_KUBE_NODE=1 scripts/services/kubernetes.sh start` "
              "(scripts/services/all.sh start does it)")
KUBECTL = str(Path(sys.executable).parent / "kubectl")


def node_installed() -> bool:
    return any(CACHE_DIR.glob("kube-node-*/kubelet"))


def require_node() -> None:
    """Skip, saying why, where the node is not installed (no kubelet built); fail, saying how to
    start it, where it is installed but not up."""
    if os.environ.get("CTXLAUNCH_KUBE_NODE_TESTS") == "0":
        pytest.skip("CTXLAUNCH_KUBE_NODE_TESTS=0: the real-node tests are turned off")
    if not node_installed():
        pytest.skip(f"the Kubernetes node is not installed (no {CACHE_DIR}/kube-node-*/kubelet): "
                    "run `scripts/services/kubernetes.sh install`")
    if not NODE_ADMIN.is_file():
        pytest.fail(f"no {NODE_ADMIN}: the single-node cluster is not up; {START_HINT}")
    result = kubectl("get", "node", "-o",
                     "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].status}",
                     check=False)
    if result.returncode != 0 or "True" not in result.stdout.split():
        pytest.fail(f"the node is not Ready ({(result.stderr or result.stdout).strip()}); "
                    f"{START_HINT}")


def kubectl(*args: str, check: bool = True, timeout: float = 60
            ) -> subprocess.CompletedProcess:
    result = subprocess.run([KUBECTL, "--kubeconfig", str(NODE_ADMIN), *args],
                            capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result


def project_image(timeout: float = 1500) -> str:
    """The project image's reference, built (or taken from the cache) and imported."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "services" / "ociimage.py"),
                             "project", "--repo", str(REPO), "--containerd",
                             str(CONTAINERD_SOCK)], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr
    sys.stderr.write(result.stderr)
    return result.stdout.strip()
