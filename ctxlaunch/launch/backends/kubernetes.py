"""Kubernetes: submit the rendered ConfigMap and PyTorchJob, or the ConfigMap, TrainingRuntime
and TrainJob (cluster.kubernetes.api: trainjob), and the PodMonitor where the Prometheus
Operator runs, with server-side apply, then watch, read, cancel and wait through the API server: over
urllib3 directly for a kubeconfig that holds only TLS material and a token (kuberest.py), else
with the official `kubernetes` client.

The objects are parsed from the very text `ctxlaunch render --target kubernetes` writes (one
code path, render.render_files), applied with field manager `ctxlaunch`. Before anything is
created the server is asked everything that could make the submission fail half-way (reachable
and accepting the credentials, PyTorchJob CRD installed, namespace there, RBAC allows the
create, no job of that name), each with a one-line error; if an object is refused all the same,
the ones created before it are deleted again, so no ConfigMap is orphaned.

States come from the PyTorchJob's conditions, which the training operator keeps (one condition
per type; Succeeded or Failed end it), or the TrainJob's, which Trainer v2 copies from its
JobSet (Complete, Failed) beside its own Suspended; both are refined by the pods' container
statuses: an OOMKilled container or a trainer that exited with the OOM status is OOM, a trainer
that refused its set-up is BAD_INPUT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.fsutil import atomic_write_text
from ctxlaunch.contract.rundir import JOB_ID_ENV
from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.launch import jobstore
from ctxlaunch.launch.backends.base import (
    Backend,
    BackendOptions,
    DryRun,
    KubernetesOptions,
    Status,
    describe_layout,
)
from ctxlaunch.launch.render import artifact_name, render_files
from ctxlaunch.launch.request import kubernetes_request

FIELD_MANAGER = "ctxlaunch"
OPERATOR_INSTALL = (
    'kubectl apply --server-side -k "github.com/kubeflow/training-operator.git/'
    'manifests/overlays/standalone?ref=v1.9.4"'
)
TRAINER_INSTALL = (
    'kubectl apply --server-side -k "github.com/kubeflow/trainer.git/'
    'manifests/overlays/manager?ref=v2.3.0"'
)
# The training operator's pod labels (kubeflow.org/v1 common_types.go).
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
# JobSet's pod label (Trainer v2 runs a TrainJob as a JobSet of the same name) and the Job
# controller's index of an Indexed Job's pod (Trainer's PET_NODE_RANK).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
CONTAINER = "pytorch"
TRAINER_CONTAINERS = ("pytorch", "node")
"""The trainer's container: PyTorchJob's and TrainJob's (Trainer v2 constants.Node)."""


@dataclass(frozen=True)
class JobApi:
    """One of the two job kinds ctxlaunch submits, and what the cluster needs for it."""

    kind: str
    group_version: str
    resource: str
    operator: str
    version: str
    install: str
    min_server: tuple[int, int]
    pod_label: str


JOB_APIS: dict[str, JobApi] = {
    "pytorchjob": JobApi(
        "PyTorchJob",
        "kubeflow.org/v1",
        "pytorchjobs",
        "the Kubeflow training operator",
        "v1.9.4",
        OPERATOR_INSTALL,
        (1, 28),
        JOB_NAME_LABEL,
    ),
    "trainjob": JobApi(
        "TrainJob",
        "trainer.kubeflow.org/v1alpha1",
        "trainjobs",
        "Kubeflow Trainer (with JobSet)",
        "v2.3.0",
        TRAINER_INSTALL,
        (1, 31),
        JOBSET_NAME_LABEL,
    ),
}
"""cluster.kubernetes.api -> the job kind; min_server: the Kubernetes version its operator
supports (training-operator 1.9: 1.28+; Trainer 2.3: 1.31+); older servers get a warning."""

RESOURCES: dict[str, tuple[str, str]] = {
    "PyTorchJob": ("/apis/kubeflow.org/v1", "pytorchjobs"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "TrainingRuntime": ("/apis/trainer.kubeflow.org/v1alpha1", "trainingruntimes"),
    "TrainJob": ("/apis/trainer.kubeflow.org/v1alpha1", "trainjobs"),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
}
"""kind -> (API group/version path, resource): every kind ctxlaunch creates (the pre-flight
permission checks ask in this order)."""

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


def job_api(record_or_api: jobstore.JobRecord | str) -> JobApi:
    """The job kind of a record (older records are PyTorchJobs) or of an api name."""
    if isinstance(record_or_api, str):
        return JOB_APIS[record_or_api]
    return JOB_APIS[record_or_api.extra.get("api", "pytorchjob")]


class KubeError(RuntimeError):
    """The API server refused or failed a request, or cannot be reached; one line."""


class ApiError(KubeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------
# the connection
# --------------------------------------------------------------------------------------------
class _ClientTransport:
    """kuberest.Direct's `send` through the official client's ApiClient (its auth settings,
    refreshes and proxy)."""

    def __init__(self, api: Any):
        self.api = api

    def send(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]],
        headers: dict[str, str],
        body: Any,
        timeout: float | None,
    ) -> Any:
        method, url, headers, serialized, post = self.api.param_serialize(
            method,
            path,
            query_params=query,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        return self.api.call_api(
            method,
            url,
            header_params=headers,
            body=serialized,
            post_params=post,
            _request_timeout=timeout,
        ).response


@dataclass
class Connection:
    """An API client for the user's kubeconfig (KUBECONFIG or ~/.kube/config, its current
    context or `context`), else the pod's service account when run inside a cluster."""

    api: Any
    """The transport: kuberest.Direct, or _ClientTransport (the official client)."""
    host: str
    context: str | None
    kubeconfig: str | None

    @classmethod
    def open(cls, context: str | None = None, kubeconfig: str | None = None) -> Connection:
        kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
        default = os.path.expanduser("~/.kube/config")
        in_cluster = (
            kubeconfig is None
            and not os.path.exists(default)
            and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        )
        if not in_cluster:
            from ctxlaunch.launch.backends import kuberest

            direct = kuberest.load(kubeconfig or default, context)
            if direct is not None:  # no official client needed (kuberest's docstring)
                return cls(direct, direct.host, direct.context, kubeconfig)
        return cls._with_client(context, kubeconfig, default, in_cluster)

    @classmethod
    def _with_client(
        cls, context: str | None, kubeconfig: str | None, default: str, in_cluster: bool
    ) -> Connection:
        """Through the official client: in a pod, and for kubeconfigs kuberest leaves to it."""
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        try:
            if in_cluster:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                context = "in-cluster"
            else:
                configuration = client.Configuration()
                config.load_kube_config(
                    config_file=kubeconfig or default,
                    context=context,
                    client_configuration=configuration,
                )
                # Record the context by name, so that later status calls reach this server
                # even after the kubeconfig's current context changed.
                context = (
                    context or config.list_kube_config_contexts(kubeconfig or default)[1]["name"]
                )
        except (ConfigException, OSError, ValueError) as exc:
            where = kubeconfig or default
            raise KubeError(
                f"no usable Kubernetes credentials in {where}"
                f"{f' (context {context})' if context else ''}: {exc}"
            ) from None
        configuration.retries = 0  # a refused connection is an answer: fail at once
        return cls(
            _ClientTransport(client.ApiClient(configuration)),
            configuration.host,
            context,
            kubeconfig,
        )

    @classmethod
    def for_record(cls, record: jobstore.JobRecord) -> Connection:
        """The same server and user the job was submitted with."""
        extra = record.extra
        if extra.get("context") == "in-cluster":
            return cls.open()
        return cls.open(extra.get("context"), extra.get("kubeconfig"))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
        timeout: float | None = 15.0,
        raw: bool = False,
    ) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body) of one request, or with `raw` the unread urllib3
        response (a log to stream or decode); ApiError for an HTTP error, KubeError when the
        server cannot be reached."""
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            response = self.api.send(method, path, query or [], headers, body, timeout)
            if raw and response.status < 400:
                return response.status, response
            data = response.read()
        except (HTTPError, OSError) as exc:
            reason = _connection_reason(exc)
            if "CERTIFICATE_VERIFY_FAILED" in reason:
                raise KubeError(
                    f"the Kubernetes API server {self.host} presents a certificate "
                    f"the kubeconfig's certificate-authority does not vouch for "
                    f"({reason})"
                ) from None
            raise KubeError(
                f"cannot reach the Kubernetes API server {self.host}: {reason}"
            ) from None
        if response.status >= 400:
            raise ApiError(response.status, _api_message(response.status, response.reason, data))
        return response.status, json.loads(data) if data else None

    def get(self, path: str, **query: str) -> Any | None:
        """The object at `path`, or None when it does not exist (404)."""
        try:
            return self.request("GET", path, query=list(query.items()))[1]
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, path: str, propagation: str = "Background") -> bool:
        """Delete the object at `path`; False when it was not there."""
        try:
            self.request(
                "DELETE",
                path,
                body={"propagationPolicy": propagation},
                content_type="application/json",
            )
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


def _api_message(status: int, reason: str, data: bytes) -> str:
    """The server's own message (a Status object's), else the HTTP status line."""
    try:
        return str(json.loads(data).get("message") or f"{status} {reason}")
    except (TypeError, ValueError, AttributeError):
        return f"{status} {reason}"


def _connection_reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", None) or exc
    text = str(reason)
    if "Connection refused" in text:
        return "connection refused (is the server running?)"
    return text.split(": ", 1)[-1] if "object at 0x" in text else text


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, resource = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{resource}"
    return f"{path}/{name}" if name else path


def job_path(namespace: str, name: str, kind: str = "PyTorchJob") -> str:
    return object_path(kind, namespace, name)


# --------------------------------------------------------------------------------------------
# the objects and the pre-flight checks
# --------------------------------------------------------------------------------------------
def rendered(spec: JobSpec, sweep: str | None = None) -> dict[str, str]:
    """The files `render --target kubernetes` writes for this spec (a sweep's points also carry
    the sweep label)."""
    return render_files(spec, "kubernetes", sweep=sweep)


def objects_of(files: dict[str, str]) -> list[dict[str, Any]]:
    """The objects in the rendered files, in file order (ConfigMap, PyTorchJob, PodMonitor)."""
    import yaml

    return [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]


def has_resource(conn: Connection, group_version: str, resource: str) -> bool:
    """Whether the server serves `resource` in `group_version` (API discovery)."""
    found = conn.get(f"/apis/{group_version}")
    if not found:
        return False
    return any(r.get("name") == resource for r in found.get("resources", []))


def allowed(
    conn: Connection, namespace: str, group: str, resource: str, verb: str
) -> tuple[bool, str]:
    """Ask the server whether this user may `verb` `resource` here (SelfSubjectAccessReview)."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {
            "resourceAttributes": {
                "namespace": namespace,
                "verb": verb,
                "group": group,
                "resource": resource,
            }
        },
    }
    _, answer = conn.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        body=review,
        content_type="application/json",
    )
    status = answer.get("status", {})
    return bool(status.get("allowed")), status.get("reason", "")


def server_version(conn: Connection) -> tuple[int, int] | None:
    """The API server's (major, minor), None when it does not say."""
    try:
        found = conn.get("/version") or {}
        return int(found["major"]), int(str(found["minor"]).rstrip("+"))
    except (ApiError, KeyError, ValueError):
        return None


def version_warning(conn: Connection, api: JobApi) -> str | None:
    """A warning when the server is older than the job kind's operator supports."""
    version = server_version(conn)
    if version is None or version >= api.min_server:
        return None
    need = ".".join(map(str, api.min_server))
    return (
        f"ctxlaunch: warning: the Kubernetes API server {conn.host} is "
        f"{version[0]}.{version[1]}; {api.operator} {api.version} needs {need} or newer for a "
        f"{api.kind}: going on, but that operator may not run it there"
    )


def preflight(
    conn: Connection,
    namespace: str,
    name: str,
    kinds: list[str],
    api: JobApi = JOB_APIS["pytorchjob"],
) -> bool:
    """Check, before anything is created, what would make the submission fail; raises KubeError
    with one line for the user. Returns whether the PodMonitor kind exists."""
    try:
        crd = has_resource(conn, api.group_version, api.resource)
    except ApiError as exc:
        if exc.status == 401:
            raise KubeError(
                f"the Kubernetes API server {conn.host} rejected the credentials "
                f"(401 Unauthorized){_context_note(conn)}: check the token or "
                "certificate in your kubeconfig"
            ) from None
        raise KubeError(
            f"the Kubernetes API server {conn.host} answered {exc.status}: {exc}"
        ) from None
    if not crd:
        raise KubeError(
            f"the API server {conn.host} has no {api.kind} kind "
            f"({api.group_version}): {api.operator} is not installed there; "
            f"install {api.version} with: {api.install} (it needs Kubernetes "
            f"{'.'.join(map(str, api.min_server))} or newer)"
        )
    try:
        if conn.get(f"/api/v1/namespaces/{namespace}") is None:
            raise KubeError(
                f"namespace {namespace!r} does not exist on {conn.host}: create it "
                f"(kubectl create namespace {namespace}) or set "
                "cluster.kubernetes.namespace"
            )
    except ApiError as exc:
        if exc.status != 403:  # may not read namespaces: the create will tell
            raise
    for kind in kinds:
        group, resource = _group_resource(kind)
        ok, reason = allowed(conn, namespace, group, resource, "create")
        if not ok:
            raise KubeError(
                f"this user may not create {resource}{'.' + group if group else ''}"
                f" in namespace {namespace!r} (RBAC){_context_note(conn)}"
                + (f": {reason}" if reason else "")
                + "; ask the cluster admin for a Role that allows it"
            )
    if conn.get(job_path(namespace, name, api.kind)) is not None:
        raise KubeError(
            f"a {api.kind} {namespace}/{name} already exists: cancel it "
            f"(ctxlaunch cancel {namespace}/{name}) or change the job's name"
        )
    return has_resource(conn, "monitoring.coreos.com/v1", "podmonitors")


def _group_resource(kind: str) -> tuple[str, str]:
    prefix, resource = RESOURCES[kind]
    group = prefix.removeprefix("/apis/").rsplit("/", 1)[0] if prefix.startswith("/apis/") else ""
    return group, resource


def _context_note(conn: Connection) -> str:
    return f" for context {conn.context}" if conn.context else ""


def apply_objects(
    conn: Connection, objects: list[dict[str, Any]], dry_run: bool = False
) -> list[dict[str, Any]]:
    """Server-side apply each object in order (field manager ctxlaunch). If one is refused,
    the objects this call created before it are deleted again, and KubeError says so."""
    query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
    if dry_run:
        query.append(("dryRun", "All"))
    created: list[dict[str, Any]] = []
    applied = []
    for obj in objects:
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        try:
            status, answer = conn.request(
                "PATCH", path, body=obj, query=query, content_type="application/apply-patch+yaml"
            )
        except KubeError as exc:
            removed = [o for o in reversed(created) if _delete_quietly(conn, o)]
            undone = (
                (
                    "; removed what was created before it: "
                    + ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in removed)
                )
                if removed
                else ""
            )
            raise KubeError(
                f"the API server refused {obj['kind']} {meta['namespace']}/"
                f"{meta['name']}: {exc}{undone}"
            ) from None
        if status == 201 and not dry_run:
            created.append(obj)
        applied.append(answer)
    return applied


def _delete_quietly(conn: Connection, obj: dict[str, Any]) -> bool:
    meta = obj["metadata"]
    try:
        return conn.delete(object_path(obj["kind"], meta["namespace"], meta["name"]))
    except KubeError:
        return False


# --------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------
class KubernetesBackend(Backend):
    """A Kubernetes cluster with the Kubeflow training operator, through its API server."""

    name = "kubernetes"

    def __init__(self, options: KubernetesOptions | None = None):
        self.options = options or KubernetesOptions()

    @classmethod
    def with_options(cls, options: BackendOptions) -> Backend:
        """The backend for this kubeconfig context, submitting or only dry-running."""
        if not isinstance(options, KubernetesOptions):
            return super().with_options(options)
        return cls(options)

    def dryrun(self, spec: JobSpec, sweep: str | None = None) -> DryRun:
        """The ConfigMap and PyTorchJob (and PodMonitor) as rendered; `sweep` labels them."""
        files = rendered(spec, sweep)
        main = artifact_name(spec, "kubernetes")
        record_id = jobstore.new_id("k8s", spec.name)
        others = {name: text for name, text in files.items() if name != main}
        return DryRun(
            target="kubernetes",
            spec=spec,
            job_id=record_id,
            command=[
                "kubectl",
                "apply",
                "--server-side",
                f"--field-manager={FIELD_MANAGER}",
                "-f",
                main,
            ],
            env={JOB_ID_ENV: record_id},
            artifact=files[main],
            artifact_name=main,
            extra_artifacts=others,
        )

    def _connect(self) -> Connection:
        return Connection.open(self.options.context, self.options.kubeconfig)

    def server_dryrun(self, dryrun: DryRun, err: IO[str] | None = None) -> int:
        """Pre-flight checks, then every object applied with dryRun=All: the server validates
        and admits them, and stores nothing."""
        err = err or sys.stderr
        conn = self._connect()
        objects = self._checked_objects(conn, dryrun, err)
        apply_objects(conn, objects, dry_run=True)
        for obj in objects:
            print(
                f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']} "
                "accepted by the server (dry run: nothing created)",
                file=err,
            )
        return exitcodes.OK

    def _checked_objects(
        self, conn: Connection, dryrun: DryRun, err: IO[str]
    ) -> list[dict[str, Any]]:
        files = {dryrun.artifact_name or "": dryrun.artifact or "", **dryrun.extra_artifacts}
        objects = objects_of(files)
        request = kubernetes_request(dryrun.spec)
        kinds = [k for k in RESOURCES if any(o["kind"] == k for o in objects)]
        api = job_api(request.api)
        monitors = preflight(conn, request.namespace, request.name, kinds, api)
        warning = version_warning(conn, api)
        if warning:
            print(warning, file=err, flush=True)
        if not monitors and any(o["kind"] == "PodMonitor" for o in objects):
            print(
                "ctxlaunch: note: the cluster has no PodMonitor kind (no Prometheus "
                "Operator): submitting the job without it; its ranks still serve /metrics",
                file=err,
                flush=True,
            )
            objects = [o for o in objects if o["kind"] != "PodMonitor"]
        return objects

    def schedule(self, dryrun: DryRun, err: IO[str] | None = None) -> int:
        """Submit the objects and print the job's namespace/name; with the server_dry_run
        option only have the server validate them."""
        if self.options.server_dry_run:
            return self.server_dryrun(dryrun, err)
        record = self.submit(dryrun, err)
        print(record.backend_id, flush=True)
        return exitcodes.OK

    def submit(self, dryrun: DryRun, err: IO[str] | None = None) -> jobstore.JobRecord:
        """Check, apply, record; returns the job's record."""
        err = err or sys.stderr
        conn = self._connect()
        objects = self._checked_objects(conn, dryrun, err)
        apply_objects(conn, objects)
        spec = dryrun.spec
        request = kubernetes_request(spec)
        record = jobstore.JobRecord(
            id=dryrun.job_id,
            name=spec.name,
            target="kubernetes",
            created=time.time(),
            backend_id=f"{request.namespace}/{request.name}",
            command=dryrun.command,
            artifact=dryrun.artifact_name,
            extra={
                "namespace": request.namespace,
                "name": request.name,
                "context": conn.context,
                "api": request.api,
                "kubeconfig": conn.kubeconfig,
                "server": conn.host,
                "objects": [[o["kind"], o["metadata"]["name"]] for o in objects],
                "ranks_per_pod": request.nproc_per_node,
                "spec": spec.model_dump(mode="json"),
            },
        )
        for name, text in {
            dryrun.artifact_name or "job.yaml": dryrun.artifact or "",
            **dryrun.extra_artifacts,
        }.items():
            atomic_write_text(record.directory / name, text)
        jobstore.save(record)
        print(
            f"ctxlaunch: submitted {job_api(request.api).kind} {record.backend_id} to {conn.host} "
            f"({record.id}); follow it with `ctxlaunch status {record.backend_id}`",
            file=err,
            flush=True,
        )
        return record

    # -- an existing job ------------------------------------------------------------------------
    def status(self, record: jobstore.JobRecord) -> Status:
        """The PyTorchJob's conditions, refined by its pods' exits and restart events; or the
        TrainJob's, refined by its pods and its JobSet's restarts."""
        return self._status(Connection.for_record(record), record)

    def _status(self, conn: Connection, record: jobstore.JobRecord) -> Status:
        namespace, name = record.extra["namespace"], record.extra["name"]
        api = job_api(record)
        job = conn.get(job_path(namespace, name, api.kind))
        if job is None:
            if record.extra.get("cancelled"):
                return Status(state="CANCELLED", scheduler_state="deleted")
            raise KeyError(record.backend_id)
        pods = job_pods(conn, namespace, name, api)
        cancelled = bool(record.extra.get("cancelled"))
        if api.kind == "TrainJob":
            return classify_trainjob(
                job, pods, jobset_restarts(conn, namespace, name), cancelled=cancelled
            )
        found = classify(job, pods, cancelled=cancelled)
        restarts = max(found.restarts, restart_events(conn, namespace, name))
        return dataclasses.replace(found, restarts=restarts)

    def read_log(self, record: jobstore.JobRecord, rank: int | None = None) -> list[str]:
        """Every pod's log (each headed by its pod's name), or one rank's lines."""
        conn = Connection.for_record(record)
        pods = self._log_pods(conn, record, rank)
        lines: list[str] = []
        for pod in pods:
            text = pod_log(conn, pod)
            if rank is None:
                if len(pods) > 1:
                    lines.append(f"==> pod {pod['metadata']['name']} <==\n")
                lines += text.splitlines(keepends=True)
            else:
                lines += rank_lines(text.splitlines(keepends=True), rank)
        return lines

    def follow_log(self, record: jobstore.JobRecord, rank: int | None = None) -> Iterator[str]:
        """The first pod's log (or rank's pod's) as it is written, until the job reaches a
        final state; waits for the pod while the job has none yet, and follows a pod the
        operator recreated under the same name (restartPolicy ExitCode) from its start."""
        conn = Connection.for_record(record)
        followed: set[str] = set()  # pods (by uid) whose log stream has ended
        while True:
            try:
                pod = self._log_pods(conn, record, rank)[0]
            except NoPodsYet:
                if self._job_over(conn, record):
                    raise
                time.sleep(FOLLOW_POLL_S)
                continue
            uid = pod["metadata"].get("uid", "")
            stream = None if uid in followed else self._open_log(conn, pod)
            if stream is None:  # its container has not started, or its log ended already
                if self._job_over(conn, record):
                    if uid not in followed:  # the kubelet's reason when it never started
                        text = pod_log(conn, pod).splitlines(keepends=True)
                        yield from text if rank is None else rank_lines(text, rank)
                    return
                time.sleep(FOLLOW_POLL_S)
                continue
            if uid not in followed and followed:
                yield f"==> pod {pod['metadata']['name']} (recreated) <==\n"
            state = functools.partial(self._follow_state, conn, record, rank, uid)
            for raw_line in follow_lines(stream, state):
                line = raw_line.decode(errors="replace")
                if rank is None:
                    yield line
                else:
                    yield from rank_lines([line], rank)
            followed.add(uid)
            if self._job_over(conn, record):
                return

    def _open_log(self, conn: Connection, pod: dict[str, Any]) -> LogStream | None:
        """The pod's trainer log as a stream (follow=true), or None while its container is
        still waiting to start (the kubelet answers 400 until then)."""
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/log"
        try:
            _, response = conn.request(
                "GET",
                path,
                query=[("container", trainer_container(pod)), ("follow", "true")],
                raw=True,
                timeout=None,
            )
        except ApiError as exc:
            if exc.status in (400, 404):  # waiting to start, or deleted in between
                return None
            raise
        return LogStream(response, lambda: _abort(response))

    def _job_over(self, conn: Connection, record: jobstore.JobRecord) -> bool:
        """Whether the job reached a final state (or is gone from the server)."""
        try:
            return self._status(conn, record).terminal
        except KeyError:
            return True

    def _follow_state(
        self, conn: Connection, record: jobstore.JobRecord, rank: int | None, uid: str
    ) -> str:
        """What follow_lines needs between reads: "over" once the job reached a final state,
        "replaced" once the followed pod is gone (deleted, or recreated under its name),
        else "running"."""
        if self._job_over(conn, record):
            return "over"
        try:
            pods = self._log_pods(conn, record, rank)
        except NoPodsYet:
            return "replaced"
        return "running" if pods[0]["metadata"].get("uid", "") == uid else "replaced"

    def _log_pods(
        self, conn: Connection, record: jobstore.JobRecord, rank: int | None
    ) -> list[dict[str, Any]]:
        namespace, name = record.extra["namespace"], record.extra["name"]
        api = job_api(record)
        pods = job_pods(conn, namespace, name, api)
        if not pods:
            raise NoPodsYet(
                f"{api.kind} {namespace}/{name} has no pods yet: "
                f"{api.operator} creates them once it sees the job (ctxlaunch status "
                f"{namespace}/{name} shows where it stands)"
            )
        if rank is None:
            return pods
        index = rank // int(record.extra.get("ranks_per_pod") or 1)
        chosen = [p for p in pods if pod_index(p) == index]
        if not chosen:
            raise NoPodsYet(f"no pod of {namespace}/{name} runs rank {rank} (yet)")
        return chosen

    def cancel(self, record: jobstore.JobRecord) -> None:
        """Delete the job (PyTorchJob or TrainJob) with foreground propagation (its pods go
        first), then its ConfigMap, TrainingRuntime and PodMonitor."""
        conn = Connection.for_record(record)
        namespace, name = record.extra["namespace"], record.extra["name"]
        kind = job_api(record).kind
        if not conn.delete(job_path(namespace, name, kind), propagation="Foreground"):
            raise KubeError(
                f"there is no {kind} {namespace}/{name} on {conn.host} (deleted already?)"
            )
        for other, object_name in record.extra.get("objects", []):
            if other != kind:
                conn.delete(object_path(other, namespace, object_name))
        record.extra["cancelled"] = True
        jobstore.save(record)

    def explain(self, record: jobstore.JobRecord, status: Status) -> list[str]:
        """The OOM with the layout that caused it, or the failing pod's last lines."""
        if status.state == "OOM":
            return [f"out of memory with {describe_layout(record.extra.get('spec', {}))}"]
        if status.state not in ("FAILED", "BAD_INPUT"):
            return []
        conn = Connection.for_record(record)
        pods = job_pods(conn, record.extra["namespace"], record.extra["name"], job_api(record))
        failed = [p for p in pods if (container_exit(p) or (None, ""))[0]]
        if not failed:
            return [status.reason] if status.reason else []
        pod = failed[0]
        code, _ = container_exit(pod) or (None, "")
        out = [f"pod {pod['metadata']['name']} exited {code}; its last lines:"]
        try:
            text = pod_log(conn, pod, tail=15)
        except KubeError as exc:
            return out[:1] + [f"(its log cannot be read: {exc})"]
        return out + (text.rstrip("\n").splitlines() or ["(its log is empty)"])

    # -- a sweep ---------------------------------------------------------------------------------
    def sweep_dryrun(self, sweep_id: str, name: str, specs: list[JobSpec]) -> DryRun:
        """One PyTorchJob (or TrainJob) per point, labelled ctxlaunch/sweep=<sweep id>."""
        return self.dryrun(specs[0], sweep=sweep_id)


class NoPodsYet(KubeError):
    """The job has no pods (yet): there is no log to read."""


# --------------------------------------------------------------------------------------------
# following a log
# --------------------------------------------------------------------------------------------
FOLLOW_POLL_S = 2.0
"""Seconds between looks at the job's state while a followed log is quiet."""
FOLLOW_DRAIN_S = 3.0
"""Once the job is over, how long a still-open log may stay quiet before following ends: nothing
guarantees that the follow stream closes when the container ends (on the real node one stayed
open past 120 s after the job's end)."""


class LogStream:
    """One pod's log as it arrives: a thread reads the lines into a queue, so that the reader
    can look at the job between them; `abort` ends the read (shuts the connection)."""

    def __init__(self, lines: Iterable[bytes], abort: Callable[[], None]):
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue()
        self._abort = abort
        self._aborted = False
        self._thread = threading.Thread(
            target=self._read, args=(lines,), daemon=True, name="ctxlaunch-log"
        )
        self._thread.start()

    def _read(self, lines: Iterable[bytes]) -> None:
        try:
            for line in lines:
                self._queue.put(line)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which decides
            self._queue.put(exc)
        self._queue.put(None)

    def get(self, timeout: float) -> bytes | None:
        """The next line; None at the stream's end; TimeoutError when none came in time."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if isinstance(item, BaseException):
            if self._aborted:
                return None
            raise KubeError(f"the log stream broke off: {item}") from item
        return item

    def close(self) -> None:
        self._aborted = True
        self._abort()


def follow_lines(
    stream: LogStream,
    state: Callable[[], str],
    poll: float | None = None,
    drain: float | None = None,
) -> Iterator[bytes]:
    """A followed log's lines until it ends, or until `state()` (asked whenever the log was
    quiet for `poll` seconds) says "replaced" (the pod is gone), or says "over" (the job
    reached a final state) and the log then stays quiet for `drain` seconds: a follow stream
    that no one closes cannot hold `logs --follow` past the job's end."""
    poll = FOLLOW_POLL_S if poll is None else poll
    drain = FOLLOW_DRAIN_S if drain is None else drain
    over = False
    try:
        while True:
            try:
                line = stream.get(drain if over else poll)
            except TimeoutError:
                if over:
                    return
                now = state()
                if now == "replaced":
                    return
                over = now == "over"
                continue
            if line is None:
                return
            yield line
    finally:
        stream.close()


def _abort(response: Any) -> None:
    """End a streamed urllib3 response from another thread: shut its socket (a blocked read
    then returns), then release it."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        response.close()


# --------------------------------------------------------------------------------------------
# states, pods and logs
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
    return sum(int(e.get("count") or 1) for e in (found or {}).get("items", []))


def jobset_restarts(conn: Connection, namespace: str, name: str) -> int:
    """How often the TrainJob's JobSet was recreated after a failed pod (status.restarts;
    0 when there is no JobSet, or no JobSet kind, or this user may not read it)."""
    try:
        found = conn.get(f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets/{name}")
    except ApiError:
        return 0
    return int(((found or {}).get("status") or {}).get("restarts") or 0)


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


def first_condition(
    job: dict[str, Any], table: list[tuple[str, str]]
) -> tuple[dict[str, Any] | None, str]:
    """The first true condition of `table`'s types and its state (PENDING when none)."""
    status = job.get("status") or {}
    true = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    condition = next((c for c in (true.get(t) for t, _ in table) if c), None)
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


def pod_nodes(pods: list[dict[str, Any]]) -> str:
    return ",".join(
        dict.fromkeys(p["spec"]["nodeName"] for p in pods if p.get("spec", {}).get("nodeName"))
    )


def classify_trainjob(
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    jobset_restarts: int = 0,
    cancelled: bool = False,
) -> Status:
    """A TrainJob (its conditions and jobsStatus), its pods and its JobSet's restart count ->
    ctxlaunch's Status, in the same states as a PyTorchJob's."""
    condition, state = first_condition(job, TRAINJOB_STATES)
    jobs = (job.get("status") or {}).get("jobsStatus") or []
    raw = condition["type"] if condition else "Submitted"
    if condition is None and any(int(j.get("active") or 0) for j in jobs):
        state, raw = "RUNNING", "Active"
    if job["metadata"].get("deletionTimestamp") or cancelled:
        state, raw = "CANCELLED", "Deleting"
    state, code, restarts = refine(state, pods)
    counts = "; ".join(
        f"{j['name']}: "
        + ", ".join(
            f"{n} {k}"
            for k in ("active", "ready", "succeeded", "failed", "suspended")
            if (n := j.get(k))
        )
        for j in jobs
        if any(j.get(k) for k in ("active", "succeeded", "failed"))
    )
    said = condition or {}
    reason = said.get("reason", "") if state not in ("RUNNING", "PENDING") else ""
    if reason and said.get("message"):
        reason = f"{reason}: {said['message']}"
    return Status(
        state=state,
        scheduler_state=raw,
        exit_code=code,
        restarts=max(restarts, jobset_restarts),
        reason="; ".join(part for part in (reason, counts) if part),
        nodes=pod_nodes(pods),
    )


def classify(job: dict[str, Any], pods: list[dict[str, Any]], cancelled: bool = False) -> Status:
    """A PyTorchJob and its pods -> ctxlaunch's Status."""
    status = job.get("status") or {}
    condition, state = first_condition(job, CONDITION_STATES)
    raw = condition["type"] if condition else "Submitted"
    if job["metadata"].get("deletionTimestamp") or cancelled:
        state, raw = "CANCELLED", "Deleting"
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
        scheduler_state=raw,
        exit_code=code,
        restarts=restarts,
        reason=reason,
        nodes=pod_nodes(pods),
    )


def trainer_container(pod: dict[str, Any]) -> str:
    """The name of the pod's trainer container (pytorch, or a TrainJob's node)."""
    names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
    return next((n for n in names if n in TRAINER_CONTAINERS), CONTAINER)


def pod_log(conn: Connection, pod: dict[str, Any], tail: int | None = None) -> str:
    meta = pod["metadata"]
    query = [("container", trainer_container(pod))]
    if tail:
        query.append(("tailLines", str(tail)))
    try:
        _, response = conn.request(
            "GET",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/log",
            query=query,
            raw=True,
        )
    except ApiError as exc:
        raise KubeError(f"the log of pod {meta['name']} cannot be read: {exc}") from None
    return response.read().decode(errors="replace")


def rank_lines(lines: list[str], rank: int) -> list[str]:
    """torchrun --role=rank --tee=3 prefixes rank r's lines with "[rank<r>]:"; keep one rank's,
    unprefixed."""
    prefix = f"[rank{rank}]:"
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]
