"""The single-node Kubernetes cluster of scripts/services/kubernetes.sh with
CTXLAUNCH_KUBE_NODE=1 (its own directory and ports beside the API-server-only one) and the
project image the node tests and benchmarks/kube_node_faults.py run, written by
scripts/services/ociimage.py. Whether a test may run on it (skip or fail) is the tests' own
rule: tests/helpers/kube_node.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from devkit import SERVICES_DIR
from devkit.pytorchjob_operator import wait_for

REPO = Path(__file__).resolve().parents[1]
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
    """Whether the node's binaries are built (scripts/services/kubernetes.sh install)."""
    return any(CACHE_DIR.glob("kube-node-*/kubelet"))


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
