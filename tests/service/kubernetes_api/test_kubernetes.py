"""Kubernetes end to end against a real kube-apiserver 1.20 with etcd, TLS, token authentication,
RBAC and the real PyTorchJob CRD (scripts/services/kubernetes.sh): plain kubectl apply/delete of
every rendered example, server-side validation, `ctxlaunch submit` / get / list / status /
cancel / wait, every pre-flight error, and a sweep.

No training operator, kubelet, scheduler or garbage collector runs on that server: objects are
stored, never acted on. Tests that need a job to move play the operator (conditions and replica
statuses through the PyTorchJob's status subresource, as the operator writes them) or the
kubelet (pod container statuses through the pods' status subresource), and say so."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.helpers.kube_api import (
    CTXLAUNCH,
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
from tests.helpers.paths import JOBS, free_port
from tests.helpers.services import KUBE_ADMIN, KUBE_CRD, KUBE_VIEWER, require_kubernetes


@pytest.fixture(scope="module", autouse=True)
def kube() -> None:
    require_kubernetes()


def submit(home: Path, namespace: str, name: str = "demo", *sets: str) -> str:
    result = ctx(home, "submit", *spec_args(namespace, name, *sets))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"{namespace}/{name}", result.stdout
    assert f"submitted PyTorchJob {namespace}/{name}" in result.stderr
    return result.stdout.strip()


def left_behind(namespace: str) -> list[str]:
    result = kubectl(
        "get",
        "pytorchjobs,configmaps",
        "-n",
        namespace,
        "-l",
        "app.kubernetes.io/name=ctxlaunch",
        "-o",
        "name",
    )
    return result.stdout.split()


# --------------------------------------------------------------------------------------------
# the rendered manifests with plain kubectl
# --------------------------------------------------------------------------------------------
EXAMPLES = sorted(p.stem for p in JOBS.glob("*.yaml") if not p.stem.startswith("invalid-"))


def image_for(example: str) -> list[str]:
    """An image for the examples written for another target (Kubernetes requires one)."""
    data = yaml.safe_load((JOBS / f"{example}.yaml").read_text())
    has_image = (data.get("cluster", {}).get("kubernetes") or {}).get("image")
    return [] if has_image else ["cluster.kubernetes.image=" + IMAGE]


@pytest.mark.parametrize("example", EXAMPLES)
def test_rendered_example_applies_and_deletes_with_plain_kubectl(
    example: str, namespace: str, tmp_path: Path
) -> None:
    """`kubectl apply -f DIR` and `kubectl delete -f DIR` of what `render --output DIR` wrote:
    the server accepts every object (also as a server dry run) and the delete removes them. In
    scrape mode the PodMonitor sits in DIR/monitoring, which this server (no Prometheus
    Operator) could not take: applied recursively it fails, as it would have in the main
    file."""
    out = render_dir(tmp_path, JOBS / f"{example}.yaml", namespace, *image_for(example))
    main = [p for p in out.glob("*.yaml")]
    assert len(main) == 1
    docs = [d for d in yaml.safe_load_all(main[0].read_text()) if d]
    name = docs[1]["metadata"]["name"]
    dry = kubectl("apply", "--dry-run=server", "-f", str(out))
    assert "(server dry run)" in dry.stdout
    assert left_behind(namespace) == []
    kubectl("apply", "-f", str(out))
    assert sorted(left_behind(namespace)) == [
        f"configmap/{name}-spec",
        f"pytorchjob.kubeflow.org/{name}",
    ]
    contains(get("pytorchjob", namespace, name)["spec"], docs[1]["spec"])
    if (out / "monitoring").is_dir():
        recursive = kubectl("apply", "-R", "-f", str(out), check=False)
        # The words depend on kubectl's discovery cache; the failure does not.
        assert recursive.returncode != 0 and "podmonitor" in recursive.stderr.lower()
    kubectl("delete", "-f", str(out))
    assert left_behind(namespace) == []


def test_the_server_rejects_a_type_error(namespace: str, tmp_path: Path) -> None:
    out = render_dir(tmp_path, JOBS / "demo.yaml", namespace, "cluster.kubernetes.image=" + IMAGE)
    docs = [d for d in yaml.safe_load_all((out / "demo.yaml").read_text()) if d]
    docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    bad = kubectl(
        "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(docs), check=False
    )
    assert bad.returncode != 0
    assert "replicas" in bad.stderr and "integer" in bad.stderr, bad.stderr


# --------------------------------------------------------------------------------------------
# ctxlaunch submit and the job's life
# --------------------------------------------------------------------------------------------
def set_job_status(namespace: str, name: str, status: dict) -> None:
    """Play the training operator: write conditions and replica statuses through the
    PyTorchJob's status subresource."""
    kubectl(
        "patch",
        "pytorchjob",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def condition(kind: str, reason: str = "") -> dict:
    return {
        "type": kind,
        "status": "True",
        "reason": reason or f"PyTorchJob{kind}",
        "message": f"PyTorchJob is {kind.lower()}.",
        "lastUpdateTime": "2026-12-01T00:00:00Z",
        "lastTransitionTime": "2026-12-01T00:00:00Z",
    }


def record_restarts(namespace: str, name: str, count: int) -> None:
    """Play the training operator: the PyTorchJobRestarting event it records on the job each
    time it replaces a failed pod (aggregated, with a count)."""
    job = get("pytorchjob", namespace, name)
    kubectl(
        "create",
        "-f",
        "-",
        stdin=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{name}.restarting", "namespace": namespace},
                "involvedObject": {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": name,
                    "namespace": namespace,
                    "uid": job["metadata"]["uid"],
                },
                "reason": "PyTorchJobRestarting",
                "type": "Warning",
                "count": count,
                "message": f"PyTorchJob {name} is restarting because 1 Master replica(s) failed.",
                "source": {"component": "pytorchjob-controller"},
                "firstTimestamp": "2026-12-01T00:00:00Z",
                "lastTimestamp": "2026-12-01T00:00:00Z",
            }
        ),
    )


def test_submit_creates_exactly_the_rendered_objects_and_follows_the_operator(
    namespace: str, home: Path, tmp_path: Path
) -> None:
    """Submit, then play the training operator through the status subresource (Created,
    Running, Restarting, Succeeded) and its restart events, and check that `status`, `list`
    and `wait` follow it."""
    job = submit(home, namespace)
    out = render_dir(
        tmp_path,
        JOBS / "demo.yaml",
        namespace,
        "cluster.kubernetes.image=" + IMAGE,
        "cluster.target=kubernetes",
    )
    configmap, pytorchjob = [d for d in yaml.safe_load_all((out / "demo.yaml").read_text()) if d]
    server_job = get("pytorchjob", namespace, "demo")
    contains(server_job["metadata"]["labels"], pytorchjob["metadata"]["labels"])
    contains(server_job["spec"], pytorchjob["spec"])
    assert get("configmap", namespace, "demo-spec")["data"] == configmap["data"]
    fields = json.loads(
        kubectl(
            "get", "pytorchjob", "demo", "-n", namespace, "-o", "json", "--show-managed-fields"
        ).stdout
    )["metadata"]["managedFields"]
    managers = {m["manager"]: m["operation"] for m in fields}
    assert managers == {"ctxlaunch": "Apply"}

    assert status(home, job)["state"] == "PENDING"
    listed = ctx(home, "list")
    assert listed.returncode == 0 and job in listed.stdout and "PENDING" in listed.stdout
    set_job_status(namespace, "demo", {"conditions": [condition("Created")]})
    assert status(home, job)["state"] == "PENDING"
    set_job_status(
        namespace,
        "demo",
        {
            "conditions": [condition("Created"), condition("Running")],
            "replicaStatuses": {"Master": {"active": 1}},
        },
    )
    running = status(home, job)
    assert running["state"] == "RUNNING" and running["scheduler_state"] == "Running"
    waited = ctx(home, "wait", job, "--timeout", "1", "--poll", "0.2")
    assert waited.returncode == 1 and "still RUNNING" in waited.stderr
    set_job_status(
        namespace, "demo", {"conditions": [condition("Created"), condition("Restarting")]}
    )
    record_restarts(namespace, "demo", 2)
    restarting = status(home, job)
    assert restarting["scheduler_state"] == "Restarting" and restarting["restarts"] == 2
    set_job_status(
        namespace,
        "demo",
        {
            "conditions": [
                condition("Created"),
                {**condition("Running"), "status": "False"},
                condition("Succeeded"),
            ],
            "replicaStatuses": {"Master": {"active": 0, "succeeded": 1}},
        },
    )
    waited = ctx(home, "wait", job, "--poll", "0.2")
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "COMPLETED" in waited.stdout and "Master: 1 succeeded" in waited.stdout


MASTER_LABELS = {
    "training.kubeflow.org/replica-type": "master",
    "training.kubeflow.org/replica-index": "0",
}


def make_pod(namespace: str, job: str, exit_code: int, reason: str) -> None:
    """Play the operator and the kubelet: a Master pod with the operator's labels whose
    trainer container terminated with `exit_code` (status subresource)."""
    play_pod(
        namespace,
        f"{job}-master-0",
        {"training.kubeflow.org/job-name": job, **MASTER_LABELS},
        "pytorch",
        exit_code=exit_code,
        reason=reason,
    )


@pytest.mark.parametrize(
    "exit_code,reason,state,wait_exit",
    [
        (86, "Error", "OOM", 86),  # the trainer's own OOM status
        (137, "OOMKilled", "OOM", 86),  # the kernel killed the container
        (2, "Error", "BAD_INPUT", 2),
        (1, "Error", "FAILED", 1),
    ],
)
def test_a_failed_job_shows_why(
    namespace: str, home: Path, exit_code: int, reason: str, state: str, wait_exit: int
) -> None:
    """Plays the operator (Failed condition) and the kubelet (the pod's terminated container,
    through the pod's status subresource): `status` shows OOM with the layout, or the failing
    pod and its log (empty: no kubelet here), and `wait` exits with the job's status."""
    job = submit(home, namespace)
    make_pod(namespace, "demo", exit_code, reason)
    set_job_status(
        namespace,
        "demo",
        {
            "conditions": [condition("Created"), condition("Failed", "PyTorchJobFailed")],
            "replicaStatuses": {"Master": {"failed": 1}},
        },
    )
    current = status(home, job)
    assert current["state"] == state and current["exit_code"] == exit_code
    if state == "OOM":
        assert current["detail"][0].startswith("out of memory with model tiny, seq_len 8192")
    else:
        assert current["detail"][0] == f"pod demo-master-0 exited {exit_code}; its last lines:"
        # No kubelet here: the server answers the pod's log with nothing.
        assert current["detail"][1:] == ["(its log is empty)"]
    waited = ctx(home, "wait", job, "--poll", "0.2")
    assert waited.returncode == wait_exit, waited.stdout + waited.stderr


def test_logs_before_pods_exist_and_cancel(namespace: str, home: Path) -> None:
    """`logs` says plainly that there are no pods yet; `cancel` deletes the job with foreground
    propagation and its ConfigMap. Without a garbage collector on this server the PyTorchJob
    keeps its foregroundDeletion finalizer: the test then plays the garbage collector (drops
    the finalizer) and the job is gone."""
    job = submit(home, namespace)
    logs = ctx(home, "logs", job)
    assert logs.returncode == 1 and "has no pods yet" in logs.stderr and logs.stdout == ""
    cancelled = ctx(home, "cancel", job)
    assert cancelled.returncode == 0, cancelled.stderr
    assert get("configmap", namespace, "demo-spec") is None
    deleting = get("pytorchjob", namespace, "demo")
    assert deleting["metadata"]["deletionTimestamp"]
    assert deleting["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert status(home, job)["state"] == "CANCELLED"
    kubectl(
        "patch",
        "pytorchjob",
        "demo",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"metadata": {"finalizers": null}}',
    )
    assert get("pytorchjob", namespace, "demo") is None
    assert status(home, job)["state"] == "CANCELLED"
    assert ctx(home, "wait", job).returncode == 1


def test_dry_runs_create_nothing(namespace: str, home: Path) -> None:
    client = ctx(home, "submit", *spec_args(namespace), "--dry-run")
    assert client.returncode == 0
    kinds = [
        d["kind"] for d in yaml.safe_load_all(client.stdout.split("# --- demo.yaml ---")[1]) if d
    ]
    assert kinds == ["ConfigMap", "PyTorchJob"]
    server = ctx(home, "submit", *spec_args(namespace), "--dry-run=server")
    assert server.returncode == 0, server.stderr
    assert f"PyTorchJob {namespace}/demo accepted by the server (dry run" in server.stderr
    assert left_behind(namespace) == [] and not (home / "jobs").exists()


def test_pod_monitor_is_left_out_where_its_crd_is_missing(namespace: str, home: Path) -> None:
    result = ctx(home, "submit", *spec_args(namespace, "scraped", "telemetry.prometheus=scrape"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("no PodMonitor kind") == 1
    assert sorted(left_behind(namespace)) == [
        "configmap/scraped-spec",
        "pytorchjob.kubeflow.org/scraped",
    ]


# --------------------------------------------------------------------------------------------
# pre-flight errors, from the real server
# --------------------------------------------------------------------------------------------
def kubeconfig_variant(tmp_path: Path, **change: str) -> Path:
    """The admin kubeconfig with its token, server or certificate authority changed."""
    config = yaml.safe_load(KUBE_ADMIN.read_text())
    if "token" in change:
        config["users"][0]["user"]["token"] = change["token"]
    if "server" in change:
        config["clusters"][0]["cluster"]["server"] = change["server"]
    if "ca" in change:  # a CA of its own, which signed nothing the server has
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=other-ca",
                "-keyout",
                change["ca"] + ".key",
                "-out",
                change["ca"],
            ],
            check=True,
            capture_output=True,
        )
        config["clusters"][0]["cluster"]["certificate-authority"] = change["ca"]
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def refused(
    home: Path, namespace: str, expected: str, kubeconfig: Path = KUBE_ADMIN, *sets: str
) -> str:
    result = ctx(home, "submit", *spec_args(namespace, "demo", *sets), kubeconfig=kubeconfig)
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and expected in message, message
    assert result.stdout == "" and not (home / "jobs").exists()
    return message


def test_preflight_errors_leave_nothing_behind(namespace: str, home: Path, tmp_path: Path) -> None:
    """Each refusal comes from the real server (or, for "down", a port nothing listens on):
    one line, exit 2, no object and no job record."""
    refused(
        home,
        namespace,
        "namespace 'ctxl-absent' does not exist",
        KUBE_ADMIN,
        "cluster.kubernetes.namespace=ctxl-absent",
    )
    refused(home, namespace, "may not create pytorchjobs.kubeflow.org in namespace", KUBE_VIEWER)
    refused(
        home,
        namespace,
        "rejected the credentials (401 Unauthorized)",
        kubeconfig_variant(tmp_path, token="not-a-valid-token"),
    )
    refused(
        home,
        namespace,
        "cannot reach the Kubernetes API server",
        kubeconfig_variant(tmp_path, server=f"https://127.0.0.1:{free_port()}"),
    )
    refused(
        home,
        namespace,
        "presents a certificate the kubeconfig's certificate-authority does not vouch for",
        kubeconfig_variant(tmp_path, ca=str(tmp_path / "other.crt")),
    )
    assert left_behind(namespace) == []
    submit(home, namespace)
    records = sorted((home / "jobs").iterdir())
    again = ctx(home, "submit", *spec_args(namespace))
    assert (
        again.returncode == 2
        and "a PyTorchJob" in again.stderr
        and "already exists" in again.stderr
    )
    assert sorted((home / "jobs").iterdir()) == records


def test_a_refused_later_object_removes_the_earlier_ones(namespace: str) -> None:
    """The server accepts the ConfigMap and refuses the PyTorchJob (a type error): the
    ConfigMap is deleted again."""
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.launch.backends.kube_apply import apply_objects, objects_of
    from ctxlaunch.launch.backends.kube_connection import Connection, KubeError
    from ctxlaunch.launch.render import render_files

    spec = load_spec(
        JOBS / "demo.yaml",
        [
            "cluster.target=kubernetes",
            f"cluster.kubernetes.image={IMAGE}",
            f"cluster.kubernetes.namespace={namespace}",
        ],
    )
    objects = objects_of(render_files(spec, "kubernetes"))
    objects[1]["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    with pytest.raises(KubeError) as info:
        apply_objects(Connection.open(kubeconfig=str(KUBE_ADMIN)), objects)
    assert "refused PyTorchJob" in str(info.value)
    assert "removed what was created before it: ConfigMap demo-spec" in str(info.value)
    assert get("configmap", namespace, "demo-spec") is None


# --------------------------------------------------------------------------------------------
# a sweep
# --------------------------------------------------------------------------------------------
def test_a_sweep_submits_one_pytorchjob_per_point(
    namespace: str, home: Path, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep.yaml"

    def write_sweep(seq_lens: list[int]) -> None:
        sweep.write_text(
            yaml.safe_dump(
                {
                    "sweep": {
                        "name": "ksw",
                        "base": str(JOBS / "demo.yaml"),
                        "set": {
                            "cluster.target": "kubernetes",
                            "cluster.kubernetes.image": IMAGE,
                            "cluster.kubernetes.namespace": namespace,
                        },
                        "axes": {"training.seq_len": seq_lens},
                    }
                }
            )
        )

    write_sweep([2048, 4096])
    result = ctx(home, "sweep", str(sweep))
    assert result.returncode == 0, result.stderr
    sweep_id = result.stdout.strip().splitlines()[-1]
    names = kubectl(
        "get",
        "pytorchjobs",
        "-n",
        namespace,
        "-l",
        f"ctxlaunch/sweep={sweep_id}",
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ).stdout.split()
    assert sorted(names) == ["ksw-2048", "ksw-4096"]
    set_job_status(namespace, "ksw-2048", {"conditions": [condition("Succeeded")]})
    report = ctx(home, "report", sweep_id, "--json")
    assert report.returncode == 0, report.stderr
    states = {row["name"]: row["state"] for row in json.loads(report.stdout)["rows"]}
    assert states == {"ksw-2048": "COMPLETED", "ksw-4096": "PENDING"}
    # Again with a third point: the two that exist are refused (and reported), the new one goes.
    write_sweep([2048, 4096, 1024])
    again = ctx(home, "sweep", str(sweep))
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already exists") == 2
    states = {
        row["name"]: row["state"]
        for row in json.loads(
            ctx(home, "report", again.stdout.strip().splitlines()[-1], "--json").stdout
        )["rows"]
    }
    assert states == {"ksw-1024": "PENDING", "ksw-2048": "SKIPPED", "ksw-4096": "SKIPPED"}


def test_logs_follow_ends_when_the_job_ended_without_pods(namespace: str, home: Path) -> None:
    """Plays the operator: the job fails before any pod exists; `logs --follow`, which waits
    for a pod while the job can still get one, then says so and ends."""
    job = submit(home, namespace)
    set_job_status(namespace, "demo", {"conditions": [condition("Failed")]})
    result = ctx(home, "logs", job, "--follow", timeout=30)
    assert result.returncode == 1 and "has no pods yet" in result.stderr


def running_pod(namespace: str, job: str) -> str:
    """Play the operator and the kubelet: a Master pod whose trainer container runs (status
    subresource); its uid."""
    return play_pod(
        namespace,
        f"{job}-master-0",
        {"training.kubeflow.org/job-name": job, **MASTER_LABELS},
        "pytorch",
    )


@pytest.mark.timeout(120)
def test_logs_follow_lasts_until_the_job_ends_through_a_recreated_pod(
    namespace: str, home: Path
) -> None:
    """Plays the operator and the kubelet. With no kubelet here the server ends every log
    stream at once (empty), as a kubelet does when a container ends: `logs --follow` must not
    end with the stream while the job runs, must follow the pod the operator recreates under
    the same name (restartPolicy ExitCode), and must end once the job reached a final state."""
    job = submit(home, namespace)
    set_job_status(namespace, "demo", {"conditions": [condition("Created"), condition("Running")]})
    first = running_pod(namespace, "demo")
    env = {**os.environ, "CTXLAUNCH_HOME": str(home), "KUBECONFIG": str(KUBE_ADMIN)}
    follow = subprocess.Popen(
        [CTXLAUNCH, "logs", job, "--follow"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The pod is replaced only once the follower asks the server (its start takes seconds
        # on a busy machine): else the replacement is the first pod it sees.
        server = yaml.safe_load(KUBE_ADMIN.read_text())["clusters"][0]["cluster"]["server"]
        port = urlsplit(server).port
        wait_until(
            lambda: follow.poll() is not None or connected_to(follow.pid, port),
            "the follower's first request",
            timeout=60,
        )
        with pytest.raises(subprocess.TimeoutExpired):
            follow.wait(timeout=3)  # the stream ended, the job runs: still following
        kubectl("delete", "pod", "demo-master-0", "-n", namespace, "--wait=true")
        assert running_pod(namespace, "demo") != first
        with pytest.raises(subprocess.TimeoutExpired):
            follow.wait(timeout=6)
        set_job_status(
            namespace, "demo", {"conditions": [condition("Created"), condition("Succeeded")]}
        )
        out, err = follow.communicate(timeout=30)  # ends within a poll or two of the end
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    assert out == "==> pod demo-master-0 (recreated) <==\n", out


@pytest.mark.parametrize(
    "conditions,state",
    [
        ([], "PENDING"),
        (["Created"], "PENDING"),
        (["Created", "Running"], "RUNNING"),
        (["Created", "Restarting"], "PENDING"),
        (["Created", "Suspended"], "SUSPENDED"),
        (["Created", "Running", "Succeeded"], "COMPLETED"),
        (["Created", "Running", "Failed"], "FAILED"),
    ],
)
def test_conditions_map_to_the_state_table(conditions: list[str], state: str) -> None:
    from ctxlaunch.launch.backends.kube_states import classify

    job = {"metadata": {"name": "j"}, "status": {"conditions": [condition(c) for c in conditions]}}
    assert classify(job, []).state == state


def test_rank_lines_pick_one_ranks_pod_and_lines() -> None:
    from ctxlaunch.launch.backends.kube_logs import rank_lines
    from ctxlaunch.launch.backends.kube_states import pod_index

    labels = "training.kubeflow.org/replica-type", "training.kubeflow.org/replica-index"
    master = {"metadata": {"labels": {labels[0]: "master", labels[1]: "0"}}}
    worker = {"metadata": {"labels": {labels[0]: "worker", labels[1]: "2"}}}
    assert (pod_index(master), pod_index(worker)) == (0, 3)
    assert rank_lines(["[rank1]:a\n", "[rank10]:b\n", "[rank1]:c\n", "agent\n"], 1) == [
        "a\n",
        "c\n",
    ]


STAND_IN_PODMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "PodMonitor",
            "plural": "podmonitors",
            "singular": "podmonitor",
            "listKind": "PodMonitorList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def connected_to(pid: int, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to `port` (its sockets,
    matched by inode in its network namespace's tables)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
        tables = [Path(f"/proc/{pid}/net/{name}").read_text() for name in ("tcp", "tcp6")]
    except OSError:  # it has ended
        return False
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    for table in tables:
        for row in table.splitlines()[1:]:
            fields = row.split()
            established = fields[3] == "01"
            if established and int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                return True
    return False


def wait_until(check, what: str, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        time.sleep(0.5)


def test_pod_monitor_is_applied_and_cancelled_where_its_kind_exists(
    namespace: str, home: Path, tmp_path: Path
) -> None:
    """No package here ships the Prometheus Operator's CRD, so the test installs a stand-in: a
    CRD of the same group, version and kind that accepts any spec. ctxlaunch then applies the
    rendered PodMonitor with the job (no note), and `cancel` deletes it."""
    kubectl("apply", "-f", "-", stdin=json.dumps(STAND_IN_PODMONITOR_CRD))
    try:
        wait_until(
            lambda: (
                kubectl(
                    "wait",
                    "--for=condition=Established",
                    "--timeout=2s",
                    "crd/podmonitors.monitoring.coreos.com",
                    check=False,
                ).returncode
                == 0
            ),
            "the stand-in CRD established",
        )
        result = ctx(
            home, "submit", *spec_args(namespace, "scraped", "telemetry.prometheus=scrape")
        )
        assert result.returncode == 0, result.stderr
        assert "no PodMonitor kind" not in result.stderr
        out = render_dir(
            tmp_path,
            JOBS / "demo.yaml",
            namespace,
            "name=scraped",
            "cluster.kubernetes.image=" + IMAGE,
            "telemetry.prometheus=scrape",
        )
        (rendered,) = yaml.safe_load_all((out / "monitoring/scraped-podmonitor.yaml").read_text())
        contains(get("podmonitor", namespace, "scraped")["spec"], rendered["spec"])
        assert ctx(home, "cancel", f"{namespace}/scraped").returncode == 0
        assert get("podmonitor", namespace, "scraped") is None
        assert get("configmap", namespace, "scraped-spec") is None
    finally:
        kubectl("delete", "crd", "podmonitors.monitoring.coreos.com", "--wait=false")
        wait_until(
            lambda: (
                kubectl("get", "crd", "podmonitors.monitoring.coreos.com", check=False).returncode
                != 0
            ),
            "the stand-in CRD deleted",
        )


# --------------------------------------------------------------------------------------------
# last: the CRD itself is taken away and put back
# --------------------------------------------------------------------------------------------
def test_missing_crd_says_how_to_install_the_operator(namespace: str, home: Path) -> None:
    """Deletes the PyTorchJob CRD from the real server, checks the refusal, and installs the CRD
    again as kubernetes.sh did. The server deletes the CRD only once no PyTorchJob is left, and
    no garbage collector runs here to finish a foreground deletion: the test plays it, dropping
    leftover foregroundDeletion finalizers first."""
    listed = json.loads(kubectl("get", "pytorchjobs", "-A", "-o", "json").stdout)["items"]
    for job in listed:
        if job["metadata"].get("finalizers"):
            kubectl(
                "patch",
                "pytorchjob",
                job["metadata"]["name"],
                "-n",
                job["metadata"]["namespace"],
                "--type=merge",
                "-p",
                '{"metadata": {"finalizers": null}}',
            )
    kubectl("delete", "crd", "pytorchjobs.kubeflow.org", "--wait=false")
    try:
        wait_until(
            lambda: kubectl("get", "crd", "pytorchjobs.kubeflow.org", check=False).returncode != 0,
            "the CRD deleted",
        )
        message = refused(home, namespace, "has no PyTorchJob kind (kubeflow.org/v1)")
        assert "training operator is not installed" in message
        assert "kubectl apply --server-side -k" in message
    finally:
        wait_until(
            lambda: (
                kubectl(
                    "apply", "--server-side", "--force-conflicts", "-f", str(KUBE_CRD), check=False
                ).returncode
                == 0
                and kubectl(
                    "wait",
                    "--for=condition=Established",
                    "--timeout=2s",
                    "crd/pytorchjobs.kubeflow.org",
                    check=False,
                ).returncode
                == 0
            ),
            "the CRD established again",
        )
