"""Kubernetes end to end on a real single-node cluster (scripts/services/kubernetes.sh with
CTXLAUNCH_KUBE_NODE=1): etcd, kube-apiserver, kube-controller-manager (service-account tokens,
Endpoints, garbage collection), kube-scheduler, and a kubelet running containerd + runc with the
bridge CNI plugin. Service names resolve through dnsmasq fed from the Endpoints by
scripts/services/kube_dns_feed.py: a stand-in for CoreDNS, which nothing here packages. The pods
run the project's own image, written here without any registry (scripts/services/ociimage.py)
and imported into containerd.

No training operator can be installed here (nothing this machine reaches ships it), so
devkit/pytorchjob_operator.py plays training-operator 1.9's part: pods and headless
services from the PyTorchJob's replica templates, their environment and init container,
restartPolicy ExitCode, and the conditions it writes. Everything below it is real: the
scheduler binds the pods, the kubelet runs them, exit codes and OOMKilled come from the runtime
and the memory cgroup. The tests share one cluster and one image; each uses its own namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.kube_node import (
    CONTAINERD_SOCK,
    CTXLAUNCH,
    NODE_ADMIN,
    ctx,
    job_pods,
    kubectl,
    new_namespace,
    submit_args,
    with_checkpoint_volume,
)
from devkit.pytorchjob_operator import PyTorchJobOperator, wait_for
from tests.helpers.inprocess import status_now
from tests.helpers.paths import JOBS

TINY = (
    "training.seq_len=1024",
    "training.steps=4",
    "training.log_interval=1",
    "cluster.kubernetes.shm_size=256Mi",
)
"""The demo model, a few short steps: seconds of training once the pods run."""


@pytest.fixture
def namespace(image: str) -> Iterator[str]:
    name = new_namespace("node")
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def operator(namespace: str, image: str) -> Iterator[PyTorchJobOperator]:
    stand_in = PyTorchJobOperator(str(NODE_ADMIN), namespace, init_image=image).start()
    yield stand_in
    stand_in.stop()
    assert not stand_in.errors, stand_in.errors


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def submit(home: Path, image: str, namespace: str, name: str, *sets: str) -> str:
    result = ctx(home, "submit", *submit_args(image, namespace, name, *TINY, *sets))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def status(home: Path, job: str) -> dict:
    """What `ctxlaunch status JOB --json` prints, read in this process (the polls' reads)."""
    return status_now(home, job, KUBECONFIG=str(NODE_ADMIN))


def owned_left(namespace: str, job: str) -> list[str]:
    result = kubectl(
        "get",
        "pods,services,configmaps",
        "-n",
        namespace,
        "-o",
        "name",
        "-l",
        f"training.kubeflow.org/job-name={job}",
    )
    spec = kubectl("get", "configmap", f"{job}-spec", "-n", namespace, "-o", "name", check=False)
    return result.stdout.split() + spec.stdout.split()


@pytest.mark.timeout(900)
def test_two_pods_train_through_the_pod_network_and_succeed(image, namespace, operator, home):
    """Master + Worker, one gloo rank each (CP 2 across the two pods), over the bridge: the
    Worker's init container waits for the Master's name, torchrun rendezvous at
    <job>-master-0, and `logs --follow` (started before the pods exist), `wait` and `status`
    follow the job to Succeeded: following ends within seconds of the job's end (it did not
    within 120 s when it waited on the log stream alone)."""
    job = submit(home, image, namespace, "train2", "cluster.nodes=2", "cluster.gpus_per_node=1")
    assert job == f"{namespace}/train2"
    env = {**os.environ, "CTXLAUNCH_HOME": str(home), "KUBECONFIG": str(NODE_ADMIN)}
    follow = subprocess.Popen(
        [CTXLAUNCH, "logs", job, "--follow"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        waited = ctx(home, "wait", job, "--timeout", "780", "--poll", "1", timeout=800)
        assert waited.returncode == 0, (
            waited.stdout + waited.stderr + ctx(home, "status", job).stdout
        )
        # A poll (2 s) and a drain (3 s) after the job's end, plus the command's own start.
        followed, follow_err = follow.communicate(timeout=60)
    finally:
        follow.kill()
    assert follow.returncode == 0, follow_err
    found = status(home, job)
    assert found["state"] == "COMPLETED", found
    assert "rank0" in followed and "step" in followed, followed[-2000:]
    running = job_pods(namespace, "train2")
    assert sorted(p["metadata"]["name"] for p in running) == ["train2-master-0", "train2-worker-0"]
    ips = {p["status"]["podIP"] for p in running}
    assert len(ips) == 2 and all(ip.startswith("10.244.0.") for ip in ips), ips
    for pod in running:
        assert pod["status"]["phase"] == "Succeeded", pod["status"]
        assert pod["spec"]["nodeName"] == "ctxlaunch-node"
    worker = next(p for p in running if p["metadata"]["name"] == "train2-worker-0")
    init = worker["status"]["initContainerStatuses"][0]
    assert init["name"] == "init-pytorch" and init["state"]["terminated"]["exitCode"] == 0
    logs = ctx(home, "logs", job)
    # Each pod's log under its name; only rank 0 reports the steps.
    assert "==> pod train2-master-0 <==" in logs.stdout, logs
    assert "==> pod train2-worker-0 <==" in logs.stdout, logs
    assert "[rank0]:step 4/4" in logs.stdout, logs


@pytest.mark.timeout(600)
def test_calibration_runs_on_the_node_and_its_profile_comes_back(
    image, namespace, operator, home, tmp_path
):
    """`ctxlaunch calibrate SPEC --submit --wait`: the spec's own PyTorchJob, the bundled
    calibration as its one pod's command, runs on the node; the pod prints its machine profile
    to its log, and once the job has succeeded the command writes that profile here, where
    `plan` can name it (cluster.profile)."""
    out = tmp_path / "profiles" / "cpu-ib.json"
    args = submit_args(image, namespace, "calib", "cluster.kubernetes.shm_size=256Mi")
    result = ctx(
        home,
        "calibrate",
        *args,
        "--submit",
        "--wait",
        "480",
        "--profile-out",
        str(out),
        timeout=540,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"{namespace}/calib", result.stdout
    (pod,) = job_pods(namespace, "calib")
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    profile = json.loads(out.read_text())
    assert (profile["gpu"], profile["nodes"], profile["framework"]) == ("cpu", 1, "ctxlaunch")
    calibration = profile["calibration"]
    assert calibration["matmul_flops_per_second"] > 0 < calibration["link_bytes_per_second"]
    assert not list(out.parent.glob(".*"))  # nothing staged left behind
    planned = ctx(home, "plan", str(JOBS / "demo.yaml"), "--set", f"cluster.profile={out}")
    assert planned.returncode == 0, planned.stdout + planned.stderr


@pytest.mark.timeout(600)
def test_a_too_small_memory_limit_ends_oomkilled(image, namespace, operator, home):
    """The memory cgroup kills a rank, containerd reports OOMKilled, and status says OOM with
    the layout."""
    job = submit(
        home,
        image,
        namespace,
        "oom",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "parallel.cp=1",
        "cluster.kubernetes.memory=700Mi",
        "training.seq_len=65536",
    )
    found = wait_for(
        lambda: (s := status(home, job))["state"] not in ("PENDING", "RUNNING") and s,
        540,
        "the job's end",
    )
    assert found["state"] == "OOM", found
    pod = job_pods(namespace, "oom")[0]
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["reason"] == "OOMKilled", terminated
    shown = ctx(home, "status", job)
    assert "out of memory with" in shown.stdout + shown.stderr, shown


@pytest.mark.timeout(600)
def test_a_bad_input_exit_is_not_retried(image, namespace, operator, home):
    """The trainer refuses a spec whose data file is missing (exit 2, below 128): the job fails
    BAD_INPUT and its pod is never replaced."""
    job = submit(
        home,
        image,
        namespace,
        "bad",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "parallel.cp=1",
        "training.data.source=text",
        "training.data.path=/no/such/corpus.txt",
    )
    found = wait_for(
        lambda: (s := status(home, job))["state"] not in ("PENDING", "RUNNING") and s,
        540,
        "the job's end",
    )
    assert found["state"] == "BAD_INPUT", found
    assert found["restarts"] == 0, found
    (pod,) = job_pods(namespace, "bad")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 2


@pytest.mark.timeout(600)
def test_cancel_leaves_nothing_behind(image, namespace, operator, home):
    """`ctxlaunch cancel` deletes the PyTorchJob; the controller manager's garbage collector
    removes the pods and services it owned, and the ConfigMap goes with it: nothing orphaned."""
    job = submit(
        home,
        image,
        namespace,
        "gone",
        "cluster.nodes=2",
        "cluster.gpus_per_node=1",
        "training.steps=100000",
    )
    wait_for(
        lambda: (
            len([p for p in job_pods(namespace, "gone") if p["status"].get("phase") == "Running"])
            == 2
        ),
        300,
        "both pods running",
    )
    assert len(owned_left(namespace, "gone")) == 5  # 2 pods, 2 services, the ConfigMap
    result = ctx(home, "cancel", job)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: not owned_left(namespace, "gone"), 180, "the garbage collection")
    assert status(home, job)["state"] == "CANCELLED"


@pytest.mark.timeout(900)
def test_a_checkpointed_stop_is_retried_and_the_new_pod_resumes(image, namespace, home, tmp_path):
    """A SIGTERM to the running container (as a node drain sends it, here through containerd)
    makes the trainer checkpoint and the pod exit 143: the operator stand-in deletes and
    recreates it (Restarting, a PyTorchJobRestarting event), the new pod resumes from the
    checkpoint on the hostPath volume and the job succeeds with one restart."""
    host_dir = tmp_path / "checkpoints"
    host_dir.mkdir()
    job = submit(
        home,
        image,
        namespace,
        "requeue",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "parallel.cp=1",
        "training.steps=30",
        "training.checkpoint.interval=1000",
        "training.checkpoint.dir=/checkpoints",
    )
    with_checkpoint_volume(namespace, "requeue", host_dir)
    stand_in = PyTorchJobOperator(str(NODE_ADMIN), namespace, init_image=image).start()
    try:
        wait_for(
            lambda: (
                "step 2/"
                in kubectl("logs", "requeue-master-0", "-n", namespace, check=False).stdout
            ),
            300,
            "step 2 in the log",
        )
        (first,) = job_pods(namespace, "requeue")
        container = first["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
        subprocess.run(
            [
                "ctr",
                "--address",
                str(CONTAINERD_SOCK),
                "-n",
                "k8s.io",
                "tasks",
                "kill",
                "-s",
                "SIGTERM",
                container,
            ],
            check=True,
            timeout=30,
        )
        waited = ctx(home, "wait", job, "--timeout", "600", "--poll", "1", timeout=620)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    finally:
        stand_in.stop()
    assert not stand_in.errors, stand_in.errors
    found = status(home, job)
    assert found["state"] == "COMPLETED" and found["restarts"] >= 1, found
    (second,) = job_pods(namespace, "requeue")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    log = kubectl("logs", "requeue-master-0", "-n", namespace).stdout
    assert "resumed from /checkpoints/step-" in log, log[-3000:]
    assert any(host_dir.glob("step-*"))
