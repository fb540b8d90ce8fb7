"""`ctxlaunch image check SPEC`: can the image a spec names start the trainer?

Runs the probe (ctxlaunch.runtime.imageprobe: torch at the pinned version, NCCL, the pods'
entry point, `ctxlaunch train --help`) in the image: through a local container runtime that
answers (docker, podman, or nerdctl in containerd's k8s.io namespace, where a kubelet's images
are), else as a one-off pod on the spec's cluster, deleted afterwards; `via="local"` runs it in
this Python instead (to check an environment before it is baked into an image).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.launch.request import container_security_context, pod_security_context

PROBE_MODULE = "ctxlaunch.runtime.imageprobe"
RUNTIMES = ("docker", "podman", "nerdctl")


@dataclass(frozen=True)
class ProbeResult:
    """What the probe printed and how it exited, and where it ran."""

    where: str
    returncode: int
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def probe_args(spec: JobSpec) -> list[str]:
    """The probe's arguments: a CPU job needs no NCCL."""
    return ["--no-nccl"] if spec.cluster.gpu == "cpu" else []


def runtime_command(runtime: str, image: str, args: list[str]) -> list[str]:
    """The command that runs the probe in `image` with a local container runtime."""
    namespace = ["--namespace", "k8s.io"] if runtime == "nerdctl" else []
    return [
        runtime,
        *namespace,
        "run",
        "--rm",
        "--entrypoint",
        "python3",
        image,
        "-m",
        PROBE_MODULE,
        *args,
    ]


def local_runtime() -> str | None:
    """The first container runtime on PATH whose daemon answers (a docker client without a
    dockerd does not)."""
    for runtime in RUNTIMES:
        path = shutil.which(runtime)
        if path is None:
            continue
        try:
            if subprocess.run([path, "info"], capture_output=True, timeout=15).returncode == 0:
                return runtime
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def check_local(spec: JobSpec) -> ProbeResult:
    result = subprocess.run(
        [sys.executable, "-m", PROBE_MODULE, *probe_args(spec)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return ProbeResult(
        "this Python (" + sys.executable + ")", result.returncode, result.stdout + result.stderr
    )


def check_runtime(spec: JobSpec, runtime: str, timeout: float = 900) -> ProbeResult:
    image = spec.cluster.kubernetes.image or ""
    try:
        result = subprocess.run(
            runtime_command(runtime, image, probe_args(spec)),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(
            f"{runtime} run {image}", 124, f"the probe did not finish within {timeout:.0f} s"
        )
    return ProbeResult(f"{runtime} run {image}", result.returncode, result.stdout + result.stderr)


def probe_pod(spec: JobSpec, name: str) -> dict[str, Any]:
    """The one-off pod: the job's image, pull secrets, node selector and tolerations, no GPU
    (the probe needs none to see NCCL in torch), never restarted."""
    k = spec.cluster.kubernetes
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        # The job's own: an image that cannot run as its pods will fails here, not in the job.
        "securityContext": pod_security_context(k),
        "containers": [
            {
                "name": "probe",
                "image": k.image,
                "imagePullPolicy": k.image_pull_policy,
                "command": ["python3", "-m", PROBE_MODULE, *probe_args(spec)],
                "securityContext": container_security_context([]),
            }
        ],
    }
    if k.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in k.image_pull_secrets]
    if k.node_selector:
        pod_spec["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_none=True) for t in k.tolerations]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": k.namespace,
            "labels": {"app.kubernetes.io/name": "ctxlaunch", "ctxlaunch/image-check": spec.name},
        },
        "spec": pod_spec,
    }


def check_pod(
    spec: JobSpec,
    context: str | None = None,
    kubeconfig: str | None = None,
    timeout: float = 600,
    poll: float = 1.0,
) -> ProbeResult:
    """Run the probe as a pod on the spec's cluster; the pod is deleted whatever happens.
    KubeError when the pod cannot be created; a result with returncode 124 when it does not
    end within `timeout` (its phase and why, e.g. an image that cannot be pulled)."""
    from ctxlaunch.launch.backends.kube_connection import Connection

    conn = Connection.open(context, kubeconfig)
    namespace = spec.cluster.kubernetes.namespace
    name = f"{spec.name}-image-check-{uuid.uuid4().hex[:6]}"
    path = f"/api/v1/namespaces/{namespace}/pods"
    conn.request("POST", path, body=probe_pod(spec, name), content_type="application/json")
    where = f"pod {namespace}/{name} on {conn.host}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            pod = conn.get(f"{path}/{name}") or {}
            phase = (pod.get("status") or {}).get("phase", "Pending")
            if phase in ("Succeeded", "Failed"):
                _, response = conn.request("GET", f"{path}/{name}/log", raw=True)
                return ProbeResult(
                    where,
                    0 if phase == "Succeeded" else 1,
                    response.read().decode(errors="replace"),
                )
            if time.monotonic() > deadline:
                return ProbeResult(
                    where,
                    124,
                    f"the pod is still {phase} after {timeout:.0f} s{pod_waiting_reason(pod)}",
                )
            time.sleep(poll)
    finally:
        conn.delete(f"{path}/{name}")


def pod_waiting_reason(pod: dict[str, Any]) -> str:
    """Why a pod is not running yet (ErrImagePull, Unschedulable, ...), as ': reason'."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return f": {waiting.get('reason')}: {waiting.get('message', '')}".rstrip(": ")
    for condition in status.get("conditions") or []:
        if condition.get("status") == "False" and condition.get("reason"):
            return f": {condition['reason']}: {condition.get('message', '')}".rstrip(": ")
    return " (no node has started it: is a scheduler and a kubelet running?)"
