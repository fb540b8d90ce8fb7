"""Kubeflow Trainer v2 (TrainJob) against the real kube-apiserver 1.20 with Trainer v2.3.0's
TrainJob, TrainingRuntime and ClusterTrainingRuntime CRDs (scripts/services/kubernetes.sh
installs them, less what a 1.20 server cannot hold): plain kubectl apply of the rendered
TrainJob and its TrainingRuntime, `ctxlaunch submit` / status / list / wait / logs / cancel, a
sweep, the pre-flight errors and the version warning.

No Trainer controller, JobSet controller, scheduler or kubelet runs on that server. Tests that
need a job to move play Trainer's controller (`trainer_status`, conditions exactly as it writes
them) or the kubelet (pod container statuses), and say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.kube_api import (
    IMAGE,
    contains,
    ctx,
    get,
    kubectl,
    play_pod,
    render_dir,
    spec_args,
    status,
)
from tests.helpers.paths import JOBS
from tests.helpers.services import KUBE_ADMIN

TRAINJOB = "cluster.kubernetes.api=trainjob"
CRDS = [
    "trainjobs.trainer.kubeflow.org",
    "trainingruntimes.trainer.kubeflow.org",
    "clustertrainingruntimes.trainer.kubeflow.org",
]


@pytest.fixture(scope="module", autouse=True)
def trainer_installed() -> None:
    from tests.helpers.services import require_kubernetes

    require_kubernetes()
    missing = [c for c in CRDS if kubectl("get", "crd", c, check=False).returncode != 0]
    if missing:
        pytest.fail(
            f"the API server lacks the Trainer v2 CRDs {missing}: restart it with "
            "scripts/services/kubernetes.sh restart (its start installs them)"
        )


def left_behind(namespace: str) -> list[str]:
    return kubectl(
        "get",
        "trainjobs,trainingruntimes,configmaps",
        "-n",
        namespace,
        "-l",
        "app.kubernetes.io/name=ctxlaunch",
        "-o",
        "name",
    ).stdout.split()


def submit(home: Path, namespace: str, name: str = "demo", *sets: str) -> str:
    result = ctx(home, "submit", *spec_args(namespace, name, TRAINJOB, *sets))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"{namespace}/{name}", result.stdout
    assert f"submitted TrainJob {namespace}/{name}" in result.stderr
    return result.stdout.strip()


def trainer_condition(kind: str, reason: str, message: str, status: str = "True") -> dict:
    """A metav1.Condition as Trainer v2.3.0's controller sets it (meta.SetStatusCondition:
    type, status, reason, message, lastTransitionTime). Complete and Failed are the JobSet's
    Completed and Failed conditions copied with the type renamed (plugins/jobset Status), so
    they carry JobSet's reasons and messages; Suspended is Trainer's own."""
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-12-01T00:00:00Z",
    }


SUSPENDED = trainer_condition("Suspended", "Suspended", "TrainJob is suspended")
RESUMED = trainer_condition("Suspended", "Resumed", "TrainJob is resumed", status="False")
COMPLETE = trainer_condition("Complete", "AllJobsCompleted", "jobset completed successfully")
FAILED = trainer_condition("Failed", "FailedJobs", "jobset failed due to one or more job failures")


def jobs_status(active: int = 0, succeeded: int = 0, failed: int = 0) -> list[dict]:
    """status.jobsStatus as Trainer copies it from the JobSet's replicatedJobsStatus (every
    count set, pointers to int32 in Go)."""
    return [
        {
            "name": "node",
            "ready": active,
            "active": active,
            "succeeded": succeeded,
            "failed": failed,
            "suspended": 0,
        }
    ]


def trainer_status(
    namespace: str, name: str, conditions: list[dict], jobs: list[dict] | None = None
) -> None:
    """Play Trainer v2's controller: write the TrainJob's status through its status
    subresource, as its reconciler's status update does."""
    body: dict = {"conditions": conditions}
    if jobs is not None:
        body["jobsStatus"] = jobs
    kubectl(
        "patch",
        "trainjob",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": body}),
    )


def make_pod(namespace: str, job: str, index: int, exit_code: int, reason: str) -> None:
    """Play the JobSet controller and the kubelet: a pod with JobSet's labels and the Job
    controller's completion index, whose trainer container (`node`) ended as given."""
    play_pod(
        namespace,
        f"{job}-node-0-{index}-abcde",
        {
            "jobset.sigs.k8s.io/jobset-name": job,
            "jobset.sigs.k8s.io/replicatedjob-name": "node",
            "batch.kubernetes.io/job-completion-index": str(index),
        },
        "node",
        exit_code=exit_code,
        reason=reason,
        node="node-a",
    )


def test_rendered_trainjob_applies_and_deletes_with_plain_kubectl(
    namespace: str, tmp_path: Path
) -> None:
    """The 64-node example as a TrainJob, with a Kueue queue and a Volcano gang: the server
    takes the TrainingRuntime and the TrainJob as rendered (also as a server dry run), and
    keeps every field."""
    out = render_dir(
        tmp_path,
        JOBS / "llama3-70b-1m-k8s.yaml",
        namespace,
        TRAINJOB,
        "cluster.kubernetes.queue=team-a",
        "cluster.kubernetes.scheduler=volcano",
        "cluster.kubernetes.scheduler_queue=gpu",
    )
    (main,) = out.glob("*.yaml")
    # The ConfigMap, the Role and RoleBinding of the job's status writer, the runtime, the job.
    *_, runtime, trainjob = [d for d in yaml.safe_load_all(main.read_text()) if d]
    dry = kubectl("apply", "--server-side", "--dry-run=server", "-f", str(main))
    assert "(server dry run)" in dry.stdout and left_behind(namespace) == []
    kubectl("apply", "--server-side", "-f", str(main))
    assert sorted(left_behind(namespace)) == [
        "configmap/llama3-70b-1m-spec",
        "trainingruntime.trainer.kubeflow.org/llama3-70b-1m-runtime",
        "trainjob.trainer.kubeflow.org/llama3-70b-1m",
    ]
    contains(get("trainingruntime", namespace, "llama3-70b-1m-runtime")["spec"], runtime["spec"])
    server_job = get("trainjob", namespace, "llama3-70b-1m")
    contains(server_job["spec"], trainjob["spec"])
    assert server_job["spec"]["suspend"] is True
    kubectl("delete", "-f", str(main))
    assert left_behind(namespace) == []


def test_submit_follows_trainer_to_completion(namespace: str, home: Path) -> None:
    """Submit with a Kueue queue (suspended), then play Trainer's controller: Suspended,
    resumed and active, Complete; `status`, `list` and `wait` follow it. The server is 1.20:
    submit warns that Trainer needs 1.31, and goes on."""
    result = ctx(
        home, "submit", *spec_args(namespace, "demo", TRAINJOB, "cluster.kubernetes.queue=team-a")
    )
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip()
    assert "warning: the Kubernetes API server" in result.stderr
    assert "Kubeflow Trainer (with JobSet) v2.3.0 needs 1.31 or newer" in result.stderr
    server_job = get("trainjob", namespace, "demo")
    assert server_job["spec"]["suspend"] is True
    assert server_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    fields = json.loads(
        kubectl(
            "get", "trainjob", "demo", "-n", namespace, "-o", "json", "--show-managed-fields"
        ).stdout
    )["metadata"]["managedFields"]
    assert {m["manager"]: m["operation"] for m in fields} == {"ctxlaunch": "Apply"}
    assert status(home, job)["state"] == "PENDING"
    trainer_status(namespace, "demo", [SUSPENDED])
    suspended = status(home, job)
    assert suspended["state"] == "SUSPENDED" and suspended["scheduler_state"] == "Suspended"
    listed = ctx(home, "list")
    assert listed.returncode == 0 and job in listed.stdout and "SUSPENDED" in listed.stdout
    trainer_status(namespace, "demo", [RESUMED], jobs_status(active=1))
    running = status(home, job)
    assert running["state"] == "RUNNING" and running["scheduler_state"] == "Active"
    waited = ctx(home, "wait", job, "--timeout", "1", "--poll", "0.2")
    assert waited.returncode == 1 and "still RUNNING" in waited.stderr
    trainer_status(namespace, "demo", [RESUMED, COMPLETE], jobs_status(succeeded=1))
    waited = ctx(home, "wait", job, "--poll", "0.2")
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "COMPLETED" in waited.stdout and "AllJobsCompleted" in waited.stdout
    assert "node: 1 succeeded" in waited.stdout


@pytest.mark.parametrize(
    "exit_code,reason,state",
    [
        (137, "OOMKilled", "OOM"),
        (86, "Error", "OOM"),
        (2, "Error", "BAD_INPUT"),
        (1, "Error", "FAILED"),
    ],
)
def test_a_failed_trainjob_shows_why(
    namespace: str, home: Path, exit_code: int, reason: str, state: str
) -> None:
    """Plays Trainer (Failed, copied from the JobSet) and the kubelet (the node container's
    exit): the same states as a PyTorchJob's; the OOM names the layout."""
    job = submit(home, namespace)
    make_pod(namespace, "demo", 0, exit_code, reason)
    trainer_status(namespace, "demo", [FAILED], jobs_status(failed=1))
    found = status(home, job)
    assert found["state"] == state and found["exit_code"] == exit_code
    assert "FailedJobs" in found["reason"] and found["nodes"] == "node-a"
    shown = ctx(home, "status", job)
    if state == "OOM":
        assert "out of memory with" in shown.stdout


def test_logs_before_pods_exist_and_cancel_removes_everything(namespace: str, home: Path) -> None:
    job = submit(home, namespace)
    logs = ctx(home, "logs", job)
    assert logs.returncode != 0 and "TrainJob" in logs.stderr and "no pods yet" in logs.stderr
    assert len(left_behind(namespace)) == 3
    cancelled = ctx(home, "cancel", job)
    assert cancelled.returncode == 0, cancelled.stderr
    # Foreground deletion: with no garbage collector here the TrainJob waits on its
    # finalizer; the runtime and the ConfigMap are gone, and the job is marked deleting.
    remaining = left_behind(namespace)
    assert remaining in ([], ["trainjob.trainer.kubeflow.org/demo"]), remaining
    assert status(home, job)["state"] == "CANCELLED"


def test_a_sweep_submits_one_trainjob_per_point(namespace: str, home: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "sweep": {
                    "name": "tsw",
                    "base": str(JOBS / "demo.yaml"),
                    "set": {
                        "cluster.target": "kubernetes",
                        "cluster.kubernetes.image": IMAGE,
                        "cluster.kubernetes.namespace": namespace,
                        "cluster.kubernetes.api": "trainjob",
                    },
                    "axes": {"training.seq_len": [2048, 4096]},
                }
            }
        )
    )
    result = ctx(home, "sweep", str(sweep))
    assert result.returncode == 0, result.stderr
    sweep_id = result.stdout.strip().splitlines()[-1]
    names = kubectl(
        "get",
        "trainjobs",
        "-n",
        namespace,
        "-l",
        f"ctxlaunch/sweep={sweep_id}",
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ).stdout.split()
    assert sorted(names) == ["tsw-2048", "tsw-4096"]
    trainer_status(namespace, "tsw-2048", [COMPLETE])
    report = ctx(home, "report", sweep_id, "--json")
    assert report.returncode == 0, report.stderr
    states = {row["name"]: row["state"] for row in json.loads(report.stdout)["rows"]}
    assert states == {"tsw-2048": "COMPLETED", "tsw-4096": "PENDING"}


def test_preflight_a_trainjob_that_exists_and_a_kind_the_server_lacks(
    namespace: str, home: Path
) -> None:
    """A second submit of the same name is refused before anything is applied; a job kind
    the server does not serve (asked through real discovery, for a version of the group no
    server has: the shared server's Trainer CRDs stay in place for the other tests) says which
    operator to install, with the pinned version."""
    from ctxlaunch.launch.backends.kube_connection import Connection, KubeError
    from ctxlaunch.launch.backends.kube_jobs import JOB_APIS
    from ctxlaunch.launch.backends.kube_preflight import preflight

    submit(home, namespace)
    again = ctx(home, "submit", *spec_args(namespace, "demo", TRAINJOB))
    assert again.returncode != 0 and "a TrainJob" in again.stderr
    assert "already exists" in again.stderr
    conn = Connection.open(kubeconfig=str(KUBE_ADMIN))
    absent = JOB_APIS["trainjob"].__class__(
        **{**JOB_APIS["trainjob"].__dict__, "group_version": "trainer.kubeflow.org/v9"}
    )
    with pytest.raises(KubeError) as caught:
        preflight(conn, namespace, "other", ["ConfigMap"], absent)
    message = str(caught.value)
    assert "has no TrainJob kind (trainer.kubeflow.org/v9)" in message
    assert "Kubeflow Trainer (with JobSet) is not installed there; install v2.3.0 with:" in message
    assert "manifests/overlays/manager?ref=v2.3.0" in message and "1.31 or newer" in message


def test_jobset_restarts_and_conditions_map_to_the_state_table() -> None:
    """The mapping alone, on objects shaped as Trainer and JobSet write them: no JobSet CRD
    exists here (../shared/crds has none), so the JobSet's status.restarts, which
    `jobset_restarts` reads from the server, is given."""
    from ctxlaunch.launch.backends.kube_states import classify_trainjob

    def job(conditions: list[dict], jobs: list[dict] | None = None) -> dict:
        return {
            "metadata": {"name": "demo"},
            "status": {"conditions": conditions, "jobsStatus": jobs or []},
        }

    assert classify_trainjob(job([]), []).state == "PENDING"
    assert classify_trainjob(job([RESUMED]), []).state == "PENDING"
    restarting = classify_trainjob(job([RESUMED], jobs_status(active=1)), [], jobset_restarts=2)
    assert restarting.state == "RUNNING" and restarting.restarts == 2
    assert classify_trainjob(job([SUSPENDED]), []).state == "SUSPENDED"
    assert classify_trainjob(job([COMPLETE]), []).state == "COMPLETED"
    # Failed wins over a stale active count; the deadline Trainer enforces itself is a failure.
    deadline = trainer_condition(
        "Failed", "DeadlineExceeded", "TrainJob exceeded its active deadline"
    )
    failed = classify_trainjob(job([deadline], jobs_status(active=1)), [])
    assert failed.state == "FAILED" and "DeadlineExceeded" in failed.reason
    gone = classify_trainjob(
        {**job([]), "metadata": {"name": "demo", "deletionTimestamp": "2026-12-01T00:00:00Z"}}, []
    )
    assert gone.state == "CANCELLED"


def test_the_1_20_server_holds_the_trainer_crds_only_as_kubernetes_sh_strips_them(
    tmp_path: Path, trainer_crds: dict[str, Path]
) -> None:
    """As shipped, the Trainer v2.3.0 CRDs are refused by the 1.20 server (CEL rules it does
    not know; past those, its empty-string defaults, see the script); after scripts/services/crd_for_1_20.py they are
    accepted (server dry runs: the installed CRDs stay as they are), with no CEL rule and no
    empty default left."""
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    shipped = trainer_crds["TrainJob"]
    # --validate=false: kubectl's own check would stop at the CEL field; this is the server's.
    refused = kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--force-conflicts",
        "--validate=false",
        "-f",
        str(shipped),
        check=False,
    )
    assert refused.returncode != 0
    assert "x-kubernetes-validations: field not declared in schema" in refused.stderr
    out = tmp_path / "crds.yaml"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/services/crd_for_1_20.py"),
            *map(str, trainer_crds.values()),
            str(out),
        ],
        check=True,
        timeout=120,
    )
    text = out.read_text()
    assert "x-kubernetes-validations" not in text and "default: ''" not in text
    accepted = kubectl(
        "apply", "--server-side", "--dry-run=server", "--force-conflicts", "-f", str(out)
    )
    assert accepted.stdout.count("serverside-applied (server dry run)") == 2
