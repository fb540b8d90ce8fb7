"""Restart and OOM on the real Kubernetes node, timed: what
tests/service/kubernetes_node/test_kubernetes_node.py checks, with the clock on each stage.

    scripts/services/all.sh start          # the single-node cluster among them
    .venv/bin/python benchmarks/kube_node_faults.py

The node, the scheduler, the kubelet, containerd and the memory cgroup are real; the PyTorchJob
controller is devkit/pytorchjob_operator.py (no training operator can be installed
here), reconciling every 0.5 s as the operator's informers would react. Host-side times come
from polling every 0.2 s (the figures are good to about that); the container's own start and end
come from the kubelet's status (whole seconds).

- requeue: the demo model, 30 steps of 1,024 tokens, one pod; a SIGTERM to the container
  through containerd (what a node drain sends) after step 2. Reported: the signal to the
  container's exit (the trainer checkpoints first), the exit to the new pod (the operator's
  delete and recreate), to its container running, to its "resumed from" line, to the job's
  Succeeded; the steps the first pod logged, the step it checkpointed and the step the second
  resumed from (steps lost = logged - resumed).
- OOM: the same model at 65,536 tokens in a 700 MiB memory limit. Reported: submit to the
  container running, to its OOMKilled end, and to `ctxlaunch status` saying OOM.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devkit.kube_node import (  # noqa: E402  the repo root is on the path only now
    CONTAINERD_SOCK,
    KUBECTL,
    NODE_ADMIN,
    ctx,
    job_pods,
    kubectl,
    new_namespace,
    project_image,
    submit_args,
    with_checkpoint_volume,
)
from devkit.pytorchjob_operator import PyTorchJobOperator, wait_for  # noqa: E402

POLL = 0.2


def submit(home: Path, image: str, namespace: str, name: str, *sets: str) -> str:
    """The demo job as one pod (one rank), with `sets`."""
    result = ctx(
        home,
        "submit",
        *submit_args(
            image,
            namespace,
            name,
            "training.log_interval=1",
            "cluster.kubernetes.shm_size=256Mi",
            "cluster.nodes=1",
            "cluster.gpus_per_node=1",
            "parallel.cp=1",
            *sets,
        ),
    )
    if result.returncode != 0:
        raise SystemExit(f"submit failed: {result.stdout}{result.stderr}")
    return result.stdout.strip()


def container(pod: dict) -> dict:
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return statuses[0]


def running_since(namespace: str, job: str, not_uid: str | None = None) -> dict | None:
    for pod in job_pods(namespace, job):
        if pod["metadata"]["uid"] != not_uid and "running" in container(pod).get("state", {}):
            return pod
    return None


def log_lines(namespace: str, pod: str) -> str:
    return kubectl("logs", pod, "-n", namespace, check=False).stdout


def requeue(image: str, home: Path) -> dict[str, object]:
    namespace = new_namespace("bench")
    host_dir = Path(tempfile.mkdtemp(prefix="kube-ckpt-"))
    out: dict[str, object] = {}
    try:
        job = submit(
            home,
            image,
            namespace,
            "requeue",
            "training.seq_len=1024",
            "training.steps=30",
            "training.checkpoint.interval=1000",
            "training.checkpoint.dir=/checkpoints",
        )
        with_checkpoint_volume(namespace, "requeue", host_dir)
        stand_in = PyTorchJobOperator(str(NODE_ADMIN), namespace, init_image=image).start()
        try:
            first = wait_for(
                lambda: running_since(namespace, "requeue"), 300, "the first pod running", POLL
            )
            follow = subprocess.Popen(
                [
                    KUBECTL,
                    "--kubeconfig",
                    str(NODE_ADMIN),
                    "logs",
                    "-f",
                    "requeue-master-0",
                    "-n",
                    namespace,
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            wait_for(
                lambda: "step 2/" in log_lines(namespace, "requeue-master-0"),
                300,
                "step 2 in the log",
                POLL,
            )
            cid = container(first)["containerID"].split("//", 1)[1]
            killed = time.monotonic()
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
                    cid,
                ],
                check=True,
                timeout=30,
            )
            first_log, _ = follow.communicate(timeout=300)
            exited = time.monotonic()

            # Until the operator's new pod appears: the first pod's end as the kubelet reports
            # it, if it is read before the operator deletes the pod (a pass or two).
            first_exit: dict = {}
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                now = job_pods(namespace, "requeue")
                if any(p["metadata"]["uid"] != first["metadata"]["uid"] for p in now):
                    break
                for p in now:
                    state = container(p).get("state", {})
                    if "terminated" in state and not first_exit:
                        first_exit = state["terminated"]
                time.sleep(0.1)
            else:
                raise AssertionError("no new pod within 300 s")
            recreated = time.monotonic()
            second = wait_for(
                lambda: running_since(namespace, "requeue", first["metadata"]["uid"]),
                300,
                "the new pod running",
                POLL,
            )
            running = time.monotonic()

            def resumed_text() -> str | None:
                text = log_lines(namespace, "requeue-master-0")
                return text if "resumed from" in text else None

            resumed_log = wait_for(resumed_text, 300, "the resume", POLL)
            resumed = time.monotonic()
            waited = ctx(home, "wait", job, "--timeout", "600", "--poll", str(POLL), timeout=620)
            done = time.monotonic()
        finally:
            stand_in.stop()
        # `ctxlaunch train` in a pod runs torchrun with --tee: each line is "[rank<r>]:..."
        steps = [int(s) for s in re.findall(r"^(?:\[rank\d+\]:)?step (\d+)/", first_log, re.M)]
        saved = re.search(r"checkpointed at step (\d+)", first_log)
        back = re.search(r"resumed from \S*step-0*(\d+)", resumed_log)
        status = json.loads(ctx(home, "status", job, "--json").stdout)
        out.update(
            {
                "signal to the container's exit (checkpoint written)": f"{exited - killed:.1f} s",
                "exit to the new pod": f"{recreated - exited:.1f} s",
                "new pod to its container running": f"{running - recreated:.1f} s",
                "running to `resumed from`": f"{resumed - running:.1f} s",
                "resumed to Succeeded (`ctxlaunch wait` returning)": f"{done - resumed:.1f} s",
                "first pod's end": (
                    f"{first_exit.get('reason')}, exit {first_exit.get('exitCode')}"
                    if first_exit
                    else "deleted before it was read"
                ),
                "steps logged by the first pod": max(steps) if steps else None,
                "checkpointed at step": int(saved.group(1)) if saved else None,
                "resumed from step": int(back.group(1)) if back else None,
                "steps lost": (max(steps) - int(back.group(1))) if steps and back else None,
                "final state, restarts": f"{status['state']}, {status.get('restarts')}",
                "wait exit code": waited.returncode,
                "second pod": second["metadata"]["name"],
            }
        )
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    return out


def oom(image: str, home: Path) -> dict[str, object]:
    namespace = new_namespace("bench")
    stand_in = PyTorchJobOperator(str(NODE_ADMIN), namespace, init_image=image).start()
    try:
        started = time.monotonic()
        job = submit(
            home,
            image,
            namespace,
            "oom",
            "cluster.kubernetes.memory=700Mi",
            "training.seq_len=65536",
            "training.steps=4",
        )
        submitted = time.monotonic()
        pod = wait_for(lambda: running_since(namespace, "oom"), 300, "the pod running", POLL)
        running = time.monotonic()

        def terminated() -> dict | None:
            for p in job_pods(namespace, "oom"):
                state = container(p).get("state", {})
                if "terminated" in state:
                    return state["terminated"]
            return None

        end = wait_for(terminated, 300, "the container's end", POLL)
        ended = time.monotonic()

        def said() -> dict | None:
            found = json.loads(ctx(home, "status", job, "--json").stdout)
            return found if found["state"] not in ("PENDING", "RUNNING") else None

        final = wait_for(said, 120, "status leaving RUNNING", POLL)
        reported = time.monotonic()
        shown = ctx(home, "status", job)
    finally:
        stand_in.stop()
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    line = next(
        (ln for ln in (shown.stdout + shown.stderr).splitlines() if "out of memory" in ln), ""
    )
    return {
        "submit (ctxlaunch submit returning)": f"{submitted - started:.1f} s",
        "submitted to the container running": f"{running - submitted:.1f} s",
        "running to its end": f"{ended - running:.1f} s",
        "the container's end": f"{end.get('reason')}, exit {end.get('exitCode')}",
        "end to `ctxlaunch status` saying it": f"{reported - ended:.1f} s",
        "status": final["state"],
        "status says": line.strip(),
        "pod": pod["metadata"]["name"],
    }


def main() -> int:
    if not NODE_ADMIN.is_file():
        print(
            f"no {NODE_ADMIN}: start the node with scripts/services/all.sh start", file=sys.stderr
        )
        return 2
    t0 = time.monotonic()
    image = project_image()
    print(f"image {image} ready in {time.monotonic() - t0:.1f} s")
    home = Path(tempfile.mkdtemp(prefix="kube-bench-home-"))
    for name, run in (("requeue after SIGTERM", requeue), ("OOM", oom)):
        print(f"\n{name}:\n")
        print("| stage | measured |\n|---|---|")
        for key, value in run(image, home).items():
            print(f"| {key} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
