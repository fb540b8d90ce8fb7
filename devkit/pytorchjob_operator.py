"""A stand-in for Kubeflow training-operator 1.9's PyTorchJob controller, for the node tests.

It stands in for the operator because none can be installed here: no registry this machine
reaches ships its image or binary, and Go modules cannot be fetched. It does what the operator's
release-1.9 source does (pkg/controller.v1/pytorch, pkg/controller.v1/common), no more:

- for every replica type and index a headless Service and a Pod named `<job>-<type>-<index>`
  (type lower-cased: `demo-master-0`, `demo-worker-0`), labelled
  training.kubeflow.org/{operator-name,job-name,replica-type,replica-index} (and
  job-role=master on the Master), both owned by the PyTorchJob (controller, blockOwnerDeletion),
  so the controller manager's garbage collector removes them with the job;
- the containers' environment as setPodEnv writes it: PYTHONUNBUFFERED, MASTER_PORT,
  PET_MASTER_PORT, MASTER_ADDR and PET_MASTER_ADDR (`<job>-master-0`), WORLD_SIZE (replicas x
  nprocPerNode), RANK and PET_NODE_RANK (the Master 0, Worker i is i + 1), PET_NPROC_PER_NODE,
  PET_NNODES;
- on Workers the init container `init-pytorch` that runs `nslookup <job>-master-0` until it
  answers (the operator's default template; its image is the operator's
  --pytorch-init-container-image, here the job's own image, which carries busybox);
- restartPolicy ExitCode: the pod's own policy is Never; a failed pod whose `pytorch` container
  exited >= 128 is deleted (and recreated on the next pass) with a PyTorchJobRestarting event and
  the Restarting condition; 1-127 fails the job;
- the conditions Created, Running, Restarting, Succeeded, Failed (reasons PyTorchJob<Type>, one
  per type, Running and Restarting exclusive, Running set false when the job ends) and the
  replica statuses, written through the status subresource.

Everything below it is real: the scheduler binds the pods, the kubelet runs them, exit codes and
OOMKilled come from the container runtime.
"""

from __future__ import annotations

import copy
import datetime
import threading
import time
import uuid
from typing import Any

OPERATOR_NAME = "pytorchjob-controller"
GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"
INIT_MAX_TRIES = 100


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def retryable(exit_code: int) -> bool:
    """pkg/util/train/train_util.go IsRetryableExitCode."""
    return exit_code >= 128


class PyTorchJobOperator:
    """Reconciles every PyTorchJob in `namespace` every `interval` seconds on a thread
    (start()/stop()), or once per reconcile(name) call."""

    def __init__(self, kubeconfig: str, namespace: str, init_image: str, interval: float = 0.5):
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.init_image = init_image
        self.interval = interval
        self.errors: list[str] = []
        self.replaced: list[dict[str, Any]] = []
        """The trainer container's termination (pod, exit_code, reason, finished_at) of each
        pod deleted to be recreated, oldest first: the pods themselves are gone."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the loop -------------------------------------------------------------------------------
    def start(self) -> PyTorchJobOperator:
        self._thread = threading.Thread(target=self._run, name="pytorchjob-operator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            try:
                jobs = self.custom.list_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL
                )
                for job in jobs.get("items", []):
                    self.reconcile_job(job)
            except ApiException as exc:
                if exc.status not in (404, 409):  # raced with a delete or another write
                    self.errors.append(f"{exc.status}: {exc.reason}")
            except Exception as exc:  # noqa: BLE001 - kept for the test to report
                self.errors.append(repr(exc))
            self._stop.wait(self.interval)

    # -- one pass over one job --------------------------------------------------------------
    def reconcile_job(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            return
        name = meta["name"]
        status = copy.deepcopy(job.get("status") or {})
        status.setdefault("conditions", [])
        before = copy.deepcopy(status)
        if not _condition(status, "Created"):
            _set_condition(status, "Created", f"PyTorchJob {name} is created.")
        replicas = job["spec"]["pytorchReplicaSpecs"]
        terminal = _is_true(status, "Succeeded") or _is_true(status, "Failed")
        pods = {
            p.metadata.name: p
            for p in self.core.list_namespaced_pod(
                self.namespace, label_selector=f"training.kubeflow.org/job-name={name}"
            ).items
        }
        replica_statuses: dict[str, dict[str, int]] = {}
        for rtype, spec in replicas.items():
            counts = {"active": 0, "succeeded": 0, "failed": 0}
            rt = rtype.lower()
            for index in range(int(spec.get("replicas", 1))):
                pod_name = f"{name}-{rt}-{index}"
                self._ensure_service(job, rt, index, spec)
                pod = pods.get(pod_name)
                if pod is None:
                    if not terminal:
                        self._create_pod(job, rtype, index, spec)
                    continue
                phase = pod.status.phase
                if phase == "Running":
                    counts["active"] += 1
                elif phase == "Succeeded":
                    counts["succeeded"] += 1
                elif phase == "Failed":
                    counts["failed"] += 1
                    code = _exit_code(pod)
                    policy = spec.get("restartPolicy", "Never")
                    if (
                        policy == "ExitCode"
                        and retryable(code)
                        or policy in ("OnFailure", "Always")
                    ):
                        if pod.metadata.deletion_timestamp is None:
                            self.replaced.append(_termination(pod))
                            self.core.delete_namespaced_pod(pod_name, self.namespace)
                            msg = (
                                f"PyTorchJob {name} is restarting because {rtype} replica(s) "
                                "failed."
                            )
                            self._event(job, "PyTorchJobRestarting", msg)
                            _set_condition(status, "Restarting", msg)
                    elif policy == "ExitCode":
                        _set_condition(
                            status,
                            "Failed",
                            f"PyTorchJob {name} is failing because {rtype} replica(s) failed.",
                        )
            replica_statuses[rtype] = counts
            expected = int(spec.get("replicas", 1)) - counts["succeeded"]
            if rtype == "Master" or "Master" not in replicas:
                if counts["active"] > 0:
                    _set_condition(status, "Running", f"PyTorchJob {name} is running.")
                if expected == 0:
                    status.setdefault("completionTime", _now())
                    _set_condition(
                        status, "Succeeded", f"PyTorchJob {name} is successfully completed."
                    )
            if counts["failed"] > 0 and int(spec.get("replicas", 1)) > (
                counts["succeeded"] + counts["active"]
            ):
                if spec.get("restartPolicy", "Never") != "Never":
                    _set_condition(
                        status,
                        "Restarting",
                        f"PyTorchJob {name} is restarting "
                        f"because {counts['failed']} {rtype} replica(s) failed.",
                    )
                else:
                    status.setdefault("completionTime", _now())
                    _set_condition(
                        status,
                        "Failed",
                        f"PyTorchJob {name} is failed because "
                        f"{counts['failed']} {rtype} replica(s) failed.",
                    )
        status["replicaStatuses"] = {
            k: {c: n for c, n in v.items() if n} for k, v in replica_statuses.items()
        }
        status.setdefault("startTime", _now())
        if status != before:
            body = {"status": status}
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, name, body
            )

    # -- what it creates ----------------------------------------------------------------------
    def _labels(self, job_name: str, rt: str, index: int) -> dict[str, str]:
        labels = {
            "training.kubeflow.org/operator-name": OPERATOR_NAME,
            "training.kubeflow.org/job-name": job_name,
            "training.kubeflow.org/replica-type": rt,
            "training.kubeflow.org/replica-index": str(index),
        }
        return labels

    def _owner(self, job: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def _ensure_service(
        self, job: dict[str, Any], rt: str, index: int, spec: dict[str, Any]
    ) -> None:
        from kubernetes.client.exceptions import ApiException

        name = f"{job['metadata']['name']}-{rt}-{index}"
        labels = self._labels(job["metadata"]["name"], rt, index)
        ports = [
            {"name": p["name"], "port": p["containerPort"]}
            for c in spec["template"]["spec"]["containers"]
            if c["name"] == CONTAINER
            for p in c.get("ports", [])
            if p.get("name")
        ]
        body = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "labels": labels, "ownerReferences": [self._owner(job)]},
            "spec": {"clusterIP": "None", "selector": labels, "ports": ports},
        }
        try:
            self.core.create_namespaced_service(self.namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise

    def pod_body(
        self, job: dict[str, Any], rtype: str, index: int, spec: dict[str, Any]
    ) -> dict[str, Any]:
        """The pod createNewPod makes from the replica's template."""
        job_name = job["metadata"]["name"]
        replicas = job["spec"]["pytorchReplicaSpecs"]
        rt = rtype.lower()
        template = copy.deepcopy(spec["template"])
        meta = template.setdefault("metadata", {})
        labels = meta.setdefault("labels", {})
        labels.update(self._labels(job_name, rt, index))
        if rtype == "Master":
            labels["training.kubeflow.org/job-role"] = "master"
        meta["name"] = f"{job_name}-{rt}-{index}"
        meta["ownerReferences"] = [self._owner(job)]
        pod_spec = template["spec"]
        nproc_text = job["spec"].get("nprocPerNode")
        nproc = int(nproc_text) if nproc_text and str(nproc_text).isdigit() else 1
        total = sum(int(r.get("replicas", 1)) for r in replicas.values())
        master_addr = f"{job_name}-master-0"
        master_port = (
            next(
                (
                    p["containerPort"]
                    for c in replicas["Master"]["template"]["spec"]["containers"]
                    if c["name"] == CONTAINER
                    for p in c.get("ports", [])
                    if p.get("name") == PORT_NAME
                ),
                None,
            )
            if "Master" in replicas
            else None
        )
        rank = index + 1 if rt == "worker" else index
        for container in pod_spec["containers"]:
            env = container.setdefault("env", [])
            env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
            if "Master" in replicas:
                env += [
                    {"name": "MASTER_PORT", "value": str(master_port)},
                    {"name": "PET_MASTER_PORT", "value": str(master_port)},
                    {"name": "MASTER_ADDR", "value": master_addr},
                    {"name": "PET_MASTER_ADDR", "value": master_addr},
                    {"name": "WORLD_SIZE", "value": str(total * nproc)},
                    {"name": "RANK", "value": str(rank)},
                    {"name": "PET_NODE_RANK", "value": str(rank)},
                ]
            if nproc_text is not None:
                env.append({"name": "PET_NPROC_PER_NODE", "value": str(nproc_text)})
            env.append({"name": "PET_NNODES", "value": str(total)})
        if rt == "worker" and "Master" in replicas:
            pod_spec.setdefault("initContainers", []).append(
                {
                    "name": "init-pytorch",
                    "image": self.init_image,
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {
                        "limits": {"cpu": "100m", "memory": "20Mi"},
                        "requests": {"cpu": "50m", "memory": "10Mi"},
                    },
                    "command": [
                        "sh",
                        "-c",
                        f"err=1;for i in $(seq {INIT_MAX_TRIES}); do if nslookup "
                        f"{master_addr}; then err=0 && break; fi;echo waiting for master; "
                        "sleep 2; done; exit $err",
                    ],
                }
            )
        policy = spec.get("restartPolicy", "Never")
        pod_spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
        return {"apiVersion": "v1", "kind": "Pod", **template}

    def _create_pod(
        self, job: dict[str, Any], rtype: str, index: int, spec: dict[str, Any]
    ) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_namespaced_pod(self.namespace, self.pod_body(job, rtype, index, spec))
        except ApiException as exc:
            if exc.status != 409:  # the old pod is still being deleted
                raise

    def _event(self, job: dict[str, Any], reason: str, message: str) -> None:
        meta = job["metadata"]
        self.core.create_namespaced_event(
            self.namespace,
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}"},
                "involvedObject": {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": meta["name"],
                    "namespace": self.namespace,
                    "uid": meta["uid"],
                },
                "reason": reason,
                "message": message,
                "type": "Warning",
                "count": 1,
                "firstTimestamp": _now(),
                "lastTimestamp": _now(),
                "source": {"component": OPERATOR_NAME},
            },
        )


# --------------------------------------------------------------------------------------------
# conditions, as pkg/util/status.go keeps them
# --------------------------------------------------------------------------------------------
def _condition(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in status["conditions"] if c["type"] == ctype), None)


def _is_true(status: dict[str, Any], ctype: str) -> bool:
    found = _condition(status, ctype)
    return bool(found and found["status"] == "True")


def _set_condition(status: dict[str, Any], ctype: str, message: str) -> None:
    """UpdateJobConditions: nothing changes once Failed; Running and Restarting replace each
    other; Succeeded or Failed set Running false."""
    if _is_true(status, "Failed"):
        return
    reason = f"{KIND}{ctype}"
    current = _condition(status, ctype)
    if current and current["status"] == "True" and current.get("reason") == reason:
        return
    now = _now()
    kept = []
    for c in status["conditions"]:
        if c["type"] == ctype or {ctype, c["type"]} == {"Running", "Restarting"}:
            continue
        if ctype in ("Failed", "Succeeded") and c["type"] == "Running":
            c = {**c, "status": "False"}
        kept.append(c)
    kept.append(
        {
            "type": ctype,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastUpdateTime": now,
            "lastTransitionTime": now,
        }
    )
    status["conditions"] = kept


def _termination(pod: Any) -> dict[str, Any]:
    for cs in pod.status.container_statuses or []:
        if cs.name == CONTAINER and cs.state and cs.state.terminated:
            terminated = cs.state.terminated
            return {
                "pod": pod.metadata.name,
                "exit_code": int(terminated.exit_code),
                "reason": terminated.reason,
                "finished_at": terminated.finished_at,
            }
    return {"pod": pod.metadata.name, "exit_code": None, "reason": None, "finished_at": None}


def _exit_code(pod: Any) -> int:
    for cs in pod.status.container_statuses or []:
        if cs.name == CONTAINER and cs.state and cs.state.terminated:
            return int(cs.state.terminated.exit_code)
    return 0


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll `predicate` until it returns something truthy; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s (last: {last!r})")
