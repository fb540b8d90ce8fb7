"""The single-node Kubernetes cluster of scripts/services/kubernetes.sh with
CTXLAUNCH_KUBE_NODE=1 (its own directory and ports beside the API-server-only one) and the
project image the node tests run, written by scripts/services/ociimage.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.pytorchjob_operator import wait_for
from tests.helpers.services import SERVICES_DIR

REPO = Path(__file__).resolve().parents[2]
NODE_DIR = SERVICES_DIR / "kubernetes-node"
NODE_ADMIN = NODE_DIR / "admin.kubeconfig"
CONTAINERD_SOCK = NODE_DIR / "run" / "containerd.sock"
CACHE_DIR = Path(
    os.environ.get("CTXLAUNCH_KUBE_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ctxlaunch"
)
NODE_TAINT_KEY = "ctxlaunch.dev/node-tests"
"""The node registers with this NoSchedule taint: only pods that tolerate it run there."""
START_HINT = (
    "start it with `CTXLAUNCH_KUBE_NODE=1 scripts/services/kubernetes.sh start` "
    "(scripts/services/all.sh start does it)"
)
KUBECTL = str(Path(sys.executable).parent / "kubectl")
CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
TOLERATION = json.dumps([{"key": NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}])
"""What a job needs in `cluster.kubernetes.tolerations` to run on the node."""


def node_installed() -> bool:
    return any(CACHE_DIR.glob("kube-node-*/kubelet"))


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


def kubectl(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [KUBECTL, "--kubeconfig", str(NODE_ADMIN), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result


def project_image(timeout: float = 1500) -> str:
    """The project image's reference, built (or taken from the cache) and imported."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "services" / "ociimage.py"),
            "project",
            "--repo",
            str(REPO),
            "--containerd",
            str(CONTAINERD_SOCK),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    sys.stderr.write(result.stderr)
    return result.stdout.strip()


def ctx(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`ctxlaunch ARGS` with its own home, against the node's API server."""
    env = {**os.environ, "CTXLAUNCH_HOME": str(home), "KUBECONFIG": str(NODE_ADMIN)}
    return subprocess.run(
        [CTXLAUNCH, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


# This node's containerd leaves a stand-in image's / at 0700 whatever its layers say, so no
# user but root can start the interpreter in it: the pods run as the image's user (root), the
# rest of the securityContext (no privilege escalation, capabilities dropped, seccomp) as
# rendered.
AS_IMAGE_USER = ("cluster.kubernetes.run_as_user=null", "cluster.kubernetes.run_as_non_root=false")


def submit_args(image: str, namespace: str, name: str, *sets: str) -> list[str]:
    """`ctxlaunch submit`'s arguments for the demo job on the node, with `sets` (PATH=VALUE)."""
    args = [str(REPO / "jobs" / "demo.yaml")]
    for item in (
        "cluster.target=kubernetes",
        f"cluster.kubernetes.image={image}",
        f"cluster.kubernetes.namespace={namespace}",
        f"name={name}",
        f"cluster.kubernetes.tolerations={TOLERATION}",
        *AS_IMAGE_USER,
        *sets,
    ):
        args += ["--set", item]
    return args


def new_namespace(prefix: str) -> str:
    """A fresh namespace, once the controller manager has made its default service account."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    wait_for(
        lambda: (
            kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0
        ),
        60,
        "the controller manager's default service account",
    )
    return name


def job_pods(namespace: str, job: str) -> list[dict]:
    """The pods of PyTorchJob `job`, as JSON."""
    result = kubectl(
        "get", "pods", "-n", namespace, "-l", f"training.kubeflow.org/job-name={job}", "-o", "json"
    )
    return json.loads(result.stdout)["items"]


def with_checkpoint_volume(namespace: str, job: str, host_dir: Path) -> None:
    """Give the submitted PyTorchJob's pod template a hostPath volume at the checkpoint
    directory (the spec has no volume field yet; on a real cluster this is a PVC), before the
    operator stand-in makes its pods."""
    host_dir.chmod(0o777)  # the pods run as a non-root user (their securityContext)
    found = json.loads(kubectl("get", "pytorchjob", job, "-n", namespace, "-o", "json").stdout)
    template = found["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    template["volumes"].append(
        {"name": "checkpoints", "hostPath": {"path": str(host_dir), "type": "Directory"}}
    )
    template["containers"][0]["volumeMounts"].append(
        {"name": "checkpoints", "mountPath": "/checkpoints"}
    )
    patch = {"spec": {"pytorchReplicaSpecs": {"Master": {"template": {"spec": template}}}}}
    kubectl("patch", "pytorchjob", job, "-n", namespace, "--type", "merge", "-p", json.dumps(patch))
