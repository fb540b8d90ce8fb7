"""Kubernetes: submit the rendered ConfigMap and PyTorchJob, or the ConfigMap, TrainingRuntime
and TrainJob (cluster.kubernetes.api: trainjob), and the PodMonitor where the Prometheus Operator
runs, then watch, read, cancel and wait through the API server.

This module is the backend; the work is done by its neighbours: kube_connection.py (the server
and user, over urllib3 directly or the official client), kube_jobs.py (the two job kinds and
their API paths), kube_preflight.py (everything that could make a submission fail half-way,
asked before anything is created), kube_apply.py (the objects, applied server-side and removed
again if one is refused), kube_states.py (the job's state from its conditions and pods) and
kube_logs.py (reading and following the pods' logs).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.fsutil import atomic_write_text
from ctxlaunch.contract.rundir import JOB_ID_ENV, TRAINING, JobEntry
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
from ctxlaunch.launch.backends.kube_apply import FIELD_MANAGER, apply_objects, objects_of, rendered
from ctxlaunch.launch.backends.kube_connection import Connection, KubeError
from ctxlaunch.launch.backends.kube_jobs import RESOURCES, job_api, job_path, object_path
from ctxlaunch.launch.backends.kube_logs import (
    FOLLOW_POLL_S,
    follow_lines,
    open_log_stream,
    pod_log,
    rank_lines,
)
from ctxlaunch.launch.backends.kube_preflight import preflight, version_warning
from ctxlaunch.launch.backends.kube_states import (
    classify,
    classify_trainjob,
    container_exit,
    job_pods,
    jobset_restarts,
    pod_index,
    restart_events,
)
from ctxlaunch.launch.render import artifact_name
from ctxlaunch.launch.request import kubernetes_request


class KubernetesBackend(Backend):
    """A Kubernetes cluster with the Kubeflow training operator, through its API server."""

    name = "kubernetes"
    shares_filesystem = False  # a pod's files stay in the pod: results come back in its log

    def __init__(self, options: KubernetesOptions | None = None):
        self.options = options or KubernetesOptions()

    @classmethod
    def with_options(cls, options: BackendOptions) -> Backend:
        """The backend for this kubeconfig context, submitting or only dry-running."""
        if not isinstance(options, KubernetesOptions):
            return super().with_options(options)
        return cls(options)

    def scheduler_name(self, record: jobstore.JobRecord) -> str:
        """The states are the job object's: a PyTorchJob's or a TrainJob's conditions."""
        return job_api(record).kind

    def dryrun(self, spec: JobSpec, entry: JobEntry = TRAINING, sweep: str | None = None) -> DryRun:
        """The ConfigMap and PyTorchJob (and PodMonitor) as rendered; `sweep` labels them;
        `entry` is what the pods run."""
        files = rendered(spec, sweep, entry)
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
            entry=entry,
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
        request = kubernetes_request(dryrun.spec, entry=dryrun.entry)
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
        request = kubernetes_request(spec, entry=dryrun.entry)
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

    def reported_progress(self, record: jobstore.JobRecord) -> dict[str, Any] | None:
        """A TrainJob's status.trainerStatus, which its rank 0 writes, as a metrics line."""
        if job_api(record).kind != "TrainJob":
            return None
        conn = Connection.for_record(record)
        job = conn.get(job_path(record.extra["namespace"], record.extra["name"], "TrainJob"))
        return trainer_status_metrics(job)

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
            stream = None if uid in followed else open_log_stream(conn, pod)
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


def trainer_status_metrics(job: dict[str, Any] | None) -> dict[str, Any] | None:
    """A TrainJob's trainerStatus (runtime.telemetry.trainjob_status writes it) in the keys of
    a metrics.jsonl line; None where it has none or holds no step."""
    found = ((job or {}).get("status") or {}).get("trainerStatus") or {}
    values: dict[str, Any] = {}
    for metric in found.get("metrics") or []:
        try:
            values[str(metric["name"])] = float(metric["value"])
        except (KeyError, TypeError, ValueError):
            continue
    if "step" not in values:
        return None
    line: dict[str, Any] = {k: v for k, v in values.items() if k not in ("step", "steps")}
    line["step"] = int(values["step"])
    line["steps"] = int(values.get("steps", 0))
    if "estimatedRemainingSeconds" in found:
        line["remaining_seconds"] = float(found["estimatedRemainingSeconds"])
    return line
