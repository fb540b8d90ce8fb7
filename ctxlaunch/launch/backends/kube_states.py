"""A Kubernetes job's state in ctxlaunch's terms, from what the API server holds about it.

A PyTorchJob's state comes from its conditions, which the training operator keeps (one
condition per type; Succeeded or Failed end it); a TrainJob's from its own, which Trainer v2
copies from its JobSet (Complete, Failed) beside its own Suspended. Both are refined by the
pods' container statuses: an OOMKilled container or a trainer that exited with the OOM status
is OOM, a trainer that refused its set-up is BAD_INPUT. Restarts come from the containers'
restart counts, the operator's restart events, or the JobSet's restart count.
"""

from __future__ import annotations

from typing import Any

from ctxlaunch.contract import exitcodes
from ctxlaunch.launch.backends.base import Status
from ctxlaunch.launch.backends.kube_connection import ApiError, Connection
from ctxlaunch.launch.backends.kube_jobs import (
    COMPLETION_INDEX,
    JOB_APIS,
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
    TRAINER_CONTAINERS,
    JobApi,
)

CONDITION_STATES: list[tuple[str, str]] = [
    ("Succeeded", "COMPLETED"),
    ("Failed", "FAILED"),
    ("Suspended", "SUSPENDED"),
    ("Restarting", "PENDING"),
    ("Running", "RUNNING"),
    ("Created", "PENDING"),
]
"""A PyTorchJob's conditions -> ctxlaunch's states, the first true one (in this order) wins:
the operator keeps the older conditions (Created stays true while Running) and sets Running
false only when the job ends. Restarting is a pod being replaced, like Slurm's REQUEUED."""


TRAINJOB_STATES: list[tuple[str, str]] = [
    ("Complete", "COMPLETED"),
    ("Failed", "FAILED"),
    ("Suspended", "SUSPENDED"),
]
"""A TrainJob's true conditions -> ctxlaunch's states, the first wins; with none of them the job
is RUNNING once a child Job is active (status.jobsStatus, copied from the JobSet), else
PENDING. A JobSet restart (status.restarts) shows as restarts, like PyTorchJob's Restarting."""


# --------------------------------------------------------------------------------------------
# what the server holds about a job
# --------------------------------------------------------------------------------------------
def job_pods(
    conn: Connection, namespace: str, name: str, api: JobApi = JOB_APIS["pytorchjob"]
) -> list[dict[str, Any]]:
    """The job's pods (the operator's job-name label, or JobSet's), by node rank (Master first,
    then Workers by index; a TrainJob's by completion index); none when this user may not list
    pods."""
    try:
        found = conn.get(
            f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"{api.pod_label}={name}"
        )
    except ApiError as exc:
        if exc.status == 403:
            return []
        raise
    return sorted((found or {}).get("items", []), key=pod_index)


def restart_events(conn: Connection, namespace: str, name: str) -> int:
    """How often the operator restarted the job: under restartPolicy ExitCode it replaces a
    pod rather than restarting its container (no restartCount), and records a
    PyTorchJobRestarting event on the job each time (events expire, after an hour by default)."""
    selector = (
        f"involvedObject.kind=PyTorchJob,involvedObject.name={name},reason=PyTorchJobRestarting"
    )
    try:
        found = conn.get(f"/api/v1/namespaces/{namespace}/events", fieldSelector=selector)
    except ApiError as exc:
        if exc.status == 403:
            return 0
        raise
    return sum(int(event.get("count") or 1) for event in (found or {}).get("items", []))


def jobset_restarts(conn: Connection, namespace: str, name: str) -> int:
    """How often the TrainJob's JobSet was recreated after a failed pod (status.restarts;
    0 when there is no JobSet, or no JobSet kind, or this user may not read it)."""
    try:
        found = conn.get(f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets/{name}")
    except ApiError:
        return 0
    return int(((found or {}).get("status") or {}).get("restarts") or 0)


# --------------------------------------------------------------------------------------------
# pods
# --------------------------------------------------------------------------------------------
def pod_index(pod: dict[str, Any]) -> int:
    """The pod's node rank: Master 0, Worker i is i + 1; a TrainJob's pod its Job completion
    index (Trainer's PET_NODE_RANK)."""
    meta = pod["metadata"]
    for where in (meta.get("labels") or {}, meta.get("annotations") or {}):
        if COMPLETION_INDEX in where:
            return int(where[COMPLETION_INDEX])
    labels = meta.get("labels", {})
    index = int(labels.get(REPLICA_INDEX_LABEL, "0") or 0)
    return index if labels.get(REPLICA_TYPE_LABEL, "master").lower() == "master" else index + 1


def container_exit(pod: dict[str, Any]) -> tuple[int, str] | None:
    """(exit code, reason) of the trainer container's last termination, if it terminated."""
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if status.get("name") not in TRAINER_CONTAINERS:
            continue
        for key in ("state", "lastState"):
            terminated = (status.get(key) or {}).get("terminated")
            if terminated:
                return int(terminated.get("exitCode", 0)), terminated.get("reason", "")
    return None


def pod_healing(pods: list[dict[str, Any]]) -> tuple[str, ...]:
    """A healing job's re-plans in words, from its pods' termination messages (the pod entry
    leaves the heal log's story there): the longest, which is the newest pod's."""
    import json

    from ctxlaunch.contract.heal_log import HEALING_KEY

    found: list[str] = []
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses") or []:
            if status.get("name") not in TRAINER_CONTAINERS:
                continue
            for key in ("state", "lastState"):
                message = ((status.get(key) or {}).get("terminated") or {}).get("message") or ""
                if HEALING_KEY not in message:
                    continue
                try:
                    stories = json.loads(message).get(HEALING_KEY) or []
                except (ValueError, AttributeError):
                    continue
                if len(stories) > len(found):
                    found = [str(story) for story in stories]
    return tuple(found)


def pod_nodes(pods: list[dict[str, Any]]) -> str:
    """The nodes the pods run on, comma-separated, each once, in the pods' order."""
    return ",".join(
        dict.fromkeys(p["spec"]["nodeName"] for p in pods if p.get("spec", {}).get("nodeName"))
    )


# --------------------------------------------------------------------------------------------
# the state
# --------------------------------------------------------------------------------------------
def first_condition(
    job: dict[str, Any], table: list[tuple[str, str]]
) -> tuple[dict[str, Any] | None, str]:
    """The first true condition of `table`'s types and its state (PENDING when none)."""
    status = job.get("status") or {}
    true_conditions = {
        c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"
    }
    condition = next((c for c in (true_conditions.get(t) for t, _ in table) if c), None)
    return condition, dict(table)[condition["type"]] if condition else "PENDING"


def refine(state: str, pods: list[dict[str, Any]]) -> tuple[str, int | None, int]:
    """(state, first non-zero exit, container restarts) from the pods: a failed job whose
    trainer was OOMKilled or exited OOM is OOM, one that exited BAD_INPUT is BAD_INPUT."""
    exits = [e for e in (container_exit(p) for p in pods) if e]
    code = next((c for c, _ in exits if c), None)
    if state == "FAILED":
        if any(r == "OOMKilled" or c == exitcodes.OOM for c, r in exits):
            state = "OOM"
        elif any(c == exitcodes.BAD_INPUT for c, _ in exits):
            state = "BAD_INPUT"
    restarts = sum(
        int(s.get("restartCount", 0))
        for p in pods
        for s in p.get("status", {}).get("containerStatuses") or []
    )
    return state, code, restarts


def classify_trainjob(
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    jobset_restarts: int = 0,
    cancelled: bool = False,
) -> Status:
    """A TrainJob (its conditions and jobsStatus), its pods and its JobSet's restart count ->
    ctxlaunch's Status, in the same states as a PyTorchJob's."""
    condition, state = first_condition(job, TRAINJOB_STATES)
    child_jobs = (job.get("status") or {}).get("jobsStatus") or []
    scheduler_state = condition["type"] if condition else "Submitted"
    if condition is None and any(int(j.get("active") or 0) for j in child_jobs):
        state, scheduler_state = "RUNNING", "Active"
    if job["metadata"].get("deletionTimestamp") or cancelled:
        state, scheduler_state = "CANCELLED", "Deleting"
    state, code, restarts = refine(state, pods)
    counts = "; ".join(
        f"{j['name']}: "
        + ", ".join(
            f"{n} {k}"
            for k in ("active", "ready", "succeeded", "failed", "suspended")
            if (n := j.get(k))
        )
        for j in child_jobs
        if any(j.get(k) for k in ("active", "succeeded", "failed"))
    )
    condition_fields = condition or {}
    reason = condition_fields.get("reason", "") if state not in ("RUNNING", "PENDING") else ""
    if reason and condition_fields.get("message"):
        reason = f"{reason}: {condition_fields['message']}"
    return Status(
        state=state,
        scheduler_state=scheduler_state,
        exit_code=code,
        restarts=max(restarts, jobset_restarts),
        reason="; ".join(part for part in (reason, counts) if part),
        nodes=pod_nodes(pods),
        healing=pod_healing(pods),
    )


def classify(job: dict[str, Any], pods: list[dict[str, Any]], cancelled: bool = False) -> Status:
    """A PyTorchJob and its pods -> ctxlaunch's Status."""
    status = job.get("status") or {}
    condition, state = first_condition(job, CONDITION_STATES)
    scheduler_state = condition["type"] if condition else "Submitted"
    if job["metadata"].get("deletionTimestamp") or cancelled:
        state, scheduler_state = "CANCELLED", "Deleting"
    state, code, restarts = refine(state, pods)
    replicas = "; ".join(
        f"{role}: "
        + ", ".join(f"{n} {k}" for k in ("active", "succeeded", "failed") if (n := counts.get(k)))
        for role, counts in sorted((status.get("replicaStatuses") or {}).items())
        if any(counts.get(k) for k in ("active", "succeeded", "failed"))
    )
    reason = (condition or {}).get("reason", "") if state not in ("RUNNING", "PENDING") else ""
    reason = "; ".join(part for part in (reason, replicas) if part)
    return Status(
        state=state,
        scheduler_state=scheduler_state,
        exit_code=code,
        restarts=restarts,
        reason=reason,
        nodes=pod_nodes(pods),
        healing=pod_healing(pods),
    )
