"""Rendering: golden files for every example, shellcheck, the real PyTorchJob CRD, and inert
rendering of hostile values."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from ctxlaunch.contract.loader import SpecError, load_spec, read_spec_data, validate_spec
from ctxlaunch.launch.render import RenderError, render, render_files
from ctxlaunch.planning.plan import plan_job
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.shell import shellcheck

EXAMPLES = sorted(JOBS.glob("*.yaml"))


def example_targets(spec) -> list[str]:
    """The artifacts each example has goldens for: its own target; the local demo is also
    rendered for Slurm, where it runs as it is on a CPU cluster."""
    return ["slurm"] if spec.cluster.target in ("local", "slurm") else ["kubernetes"]


def load_example(path: Path, target: str | None = None):
    overrides = [f"cluster.target={target}"] if target else []
    return load_spec(path, overrides)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_goldens(path: Path, check_golden) -> None:
    try:
        spec = validate_spec(read_spec_data(path), f"jobs/{path.name}")
    except SpecError as exc:
        assert path.stem.startswith("invalid-"), f"{path.name} should be valid:\n{exc}"
        check_golden(f"{path.stem}/error.txt", str(exc) + "\n")
        return
    assert not path.stem.startswith("invalid-"), f"{path.name} should be invalid"
    check_golden(
        f"{path.stem}/plan.json",
        json.dumps(plan_job(spec).to_dict(), indent=2, sort_keys=True) + "\n",
    )
    for target in example_targets(spec):
        for name, text in render_files(load_example(path, target), target).items():
            check_golden(f"{path.stem}/{name}", text)
    if example_targets(spec) == ["kubernetes"]:
        trainjob = load_spec(path, ["cluster.kubernetes.api=trainjob"])
        for name, text in render_files(trainjob, "kubernetes").items():
            check_golden(f"{path.stem}/trainjob/{name}", text)


def test_every_example_exercised() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"demo", "llama3-8b-128k-slurm", "llama3-70b-1m-k8s", "invalid-ulysses-gqa"} <= names


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if not p.stem.startswith("invalid-")], ids=lambda p: p.stem
)
def test_slurm_scripts_pass_shellcheck(path: Path, tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(render(load_example(path, "slurm"), "slurm"))
    shellcheck(script)


def test_slurm_script_launch_conventions() -> None:
    text = render(load_example(JOBS / "llama3-8b-128k-slurm.yaml"), "slurm")
    directives = [
        line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")
    ]
    assert "--nodes=4" in directives and "--ntasks-per-node=8" in directives
    assert "--gpus-per-node=8" in directives and "--requeue" in directives
    assert "--exclusive" in directives and "--signal=B:USR1@120" in directives
    assert "--partition=gpu" in directives and "--time=2-00:00:00" in directives
    # Rendezvous resolved inside the job from the allocation, not on the login node.
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and "-u -m ctxlaunch.runtime.trainer" in srun
    assert "export PYTHONUNBUFFERED=1" in text
    assert "export NCCL_IB_HCA='=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7'" in text
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in text
    assert 'if [ "${restarts}" -lt 5 ]' in text


def sbatch_directives(text: str) -> list[str]:
    """The options sbatch takes from a script: #SBATCH lines before the first command."""
    out = []
    for line in text.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            out.append(stripped)
    return out


def crd_validator(crd: Path):
    import jsonschema

    from tests.helpers.crd import pytorchjob_schema

    schema = pytorchjob_schema(crd)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def trainjob_docs(text: str) -> tuple[dict, dict]:
    """The TrainingRuntime and the TrainJob of a rendered trainjob file (after its ConfigMap
    and the RBAC that lets rank 0 write the TrainJob's status)."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds[0] == "ConfigMap" and kinds[-2:] == ["TrainingRuntime", "TrainJob"], kinds
    assert set(kinds[1:-2]) <= {"ServiceAccount", "Role", "RoleBinding"}, kinds
    return docs[-2], docs[-1]


def trainjob_pod(runtime: dict) -> dict:
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return node["template"]["spec"]["template"]


def pytorchjob_doc(text: str) -> dict:
    docs = [d for d in yaml.safe_load_all(text) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "PyTorchJob"], kinds
    return docs[1]


def test_scrape_mode_adds_metrics_ports_and_a_pod_monitor_in_its_own_folder() -> None:
    """The PodMonitor is in monitoring/, which a plain `kubectl apply -f DIR` (not recursive)
    leaves out: on a cluster without the Prometheus Operator the job applies and deletes
    cleanly (test_kubernetes applies the rendered folder to a real server)."""
    files = render_files(load_example(JOBS / "llama3-70b-1m-k8s.yaml"), "kubernetes")
    assert sorted(files) == ["llama3-70b-1m.yaml", "monitoring/llama3-70b-1m-podmonitor.yaml"]
    job = pytorchjob_doc(files["llama3-70b-1m.yaml"])
    assert "monitoring/llama3-70b-1m-podmonitor.yaml" in files["llama3-70b-1m.yaml"]
    (monitor,) = [
        d for d in yaml.safe_load_all(files["monitoring/llama3-70b-1m-podmonitor.yaml"]) if d
    ]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics-0"] == 9400 and ports["metrics-7"] == 9407
    assert monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"]["ctxlaunch/job"] == "llama3-70b-1m"
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [
        f"metrics-{r}" for r in range(8)
    ]
    assert all(e["honorLabels"] for e in monitor["spec"]["podMetricsEndpoints"])


def test_pytorchjob_validates_against_the_real_crd(pytorchjob_crd: Path) -> None:
    validator = crd_validator(pytorchjob_crd)
    text = render(load_example(JOBS / "llama3-70b-1m-k8s.yaml"), "kubernetes")
    job = pytorchjob_doc(text)
    errors = sorted(validator.iter_errors(job), key=str)
    assert not errors, "\n".join(e.message + " at " + "/".join(map(str, e.path)) for e in errors)
    # The strict schema really forbids unknown fields (so the check above means something).
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["bogus"] = 1
    assert any("bogus" in e.message for e in validator.iter_errors(job))


def test_pytorchjob_shape(pytorchjob_crd: Path) -> None:
    spec = load_example(JOBS / "llama3-70b-1m-k8s.yaml")
    job = pytorchjob_doc(render(spec, "kubernetes"))
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 63
    assert job["spec"]["nprocPerNode"] == "8"
    pod = replicas["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "pytorch"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "8"}
    # Everything dropped but what RDMA needs; never root; no API token; the pod network.
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["automountServiceAccountToken"] is False
    assert "hostNetwork" not in pod
    on_host = load_spec(JOBS / "llama3-70b-1m-k8s.yaml", ["cluster.kubernetes.host_network=true"])
    host = pytorchjob_doc(render(on_host, "kubernetes"))["spec"]["pytorchReplicaSpecs"]["Worker"][
        "template"
    ]["spec"]
    assert host["hostNetwork"] is True and host["dnsPolicy"] == "ClusterFirstWithHostNet"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NCCL_IB_HCA"].startswith("=mlx5_0,")
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    # The spec travels in a ConfigMap that the trainer reads.
    config_map = next(
        d for d in yaml.safe_load_all(render(spec, "kubernetes")) if d["kind"] == "ConfigMap"
    )
    carried = json.loads(config_map["data"]["spec.json"])
    assert validate_spec(carried).model_dump() == spec.model_dump()
    assert job["spec"]["runPolicy"]["backoffLimit"] == 5


def test_single_node_pytorchjob_has_no_workers(pytorchjob_crd: Path) -> None:
    spec = load_spec(
        JOBS / "demo.yaml",
        ["cluster.target=kubernetes", "cluster.kubernetes.image=example/ctxlaunch:1"],
    )
    job = pytorchjob_doc(render(spec, "kubernetes"))
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert not list(crd_validator(pytorchjob_crd).iter_errors(job))


HOSTILE = [
    "$(touch /tmp/ctxlaunch-pwned)",
    "`touch /tmp/ctxlaunch-pwned`",
    "'; rm -rf / #",
    '"; touch /tmp/ctxlaunch-pwned; "',
    "${HOME}",
    "back\\slash and 'single' and \"double\"",
    "=starts-with-equals",
    "ends with a backslash\\",
]
MULTI_LINE = ["line one\nline two\n#SBATCH --partition=evil", "key: value\n- list: item"]
"""Refused: a line break has no place in a value that reaches a script or a manifest."""


def hostile_spec(value: str, target: str):
    data = read_spec_data(JOBS / "demo.yaml")
    data["cluster"]["target"] = target
    data["cluster"]["gpu"] = "H100"
    data["cluster"]["kubernetes"] = {"image": "example/ctxlaunch:1"}
    data["fabric"] = {"env": {"HOSTILE": value}, "nccl": {"NCCL_ALGO": value}, "topo_file": value}
    data["training"]["checkpoint"]["dir"] = value
    return validate_spec(data)


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_are_inert_in_bash(value: str, tmp_path: Path) -> None:
    spec = hostile_spec(value, "slurm")
    text = render(spec, "slurm")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    shellcheck(script)
    # No sbatch option comes from a value: sbatch reads #SBATCH lines only up to the first
    # command, and a value never lands before it.
    assert sbatch_directives(text) == sbatch_directives(render(hostile_spec("x", "slurm"), "slurm"))
    # Run the script's environment section in bash and read the values back byte for byte.
    exports = text[text.index("set -euo pipefail") : text.index("# Rendezvous")]
    probe = tmp_path / "probe.sh"
    probe.write_text(
        exports + '\nprintf \'%s\\0\' "$HOSTILE" "$NCCL_ALGO" "$CTXLAUNCH_SPEC_JSON"\n'
    )
    result = subprocess.run(
        ["bash", str(probe)],
        capture_output=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    hostile, nccl, spec_json = result.stdout.decode().split("\0")[:3]
    assert hostile == value and nccl == value
    assert json.loads(spec_json)["training"]["checkpoint"]["dir"] == value
    assert not Path("/tmp/ctxlaunch-pwned").exists()


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_are_inert_in_yaml(value: str) -> None:
    spec = hostile_spec(value, "kubernetes")
    docs = list(yaml.safe_load_all(render(spec, "kubernetes")))
    job = pytorchjob_doc(render(spec, "kubernetes"))
    env = {
        e["name"]: e["value"]
        for e in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
            "env"
        ]
    }
    assert env["HOSTILE"] == value and env["NCCL_ALGO"] == value
    assert env["NCCL_TOPO_FILE"] == value
    assert json.loads(docs[0]["data"]["spec.json"])["training"]["checkpoint"]["dir"] == value
    assert len(docs) == 2


@pytest.mark.parametrize("value", MULTI_LINE)
def test_multi_line_values_are_refused_at_each_field(value: str) -> None:
    with pytest.raises(SpecError) as info:
        hostile_spec(value, "slurm")
    assert {p.path for p in info.value.problems} == {
        "fabric.env.HOSTILE",
        "fabric.nccl.NCCL_ALGO",
        "fabric.topo_file",
        "training.checkpoint.dir",
    }


@pytest.mark.parametrize(
    "name", ["$(reboot)", "a'b", "evil\nname", "demo\n", "UPPER", "a b", "-lead", "x" * 49]
)
def test_hostile_job_names_are_rejected(name: str) -> None:
    data = read_spec_data(JOBS / "demo.yaml")
    data["name"] = name
    with pytest.raises(SpecError) as info:
        validate_spec(data)
    assert info.value.problems[0].path == "name"


def test_templates_refuse_unquoted_values(tmp_path: Path, monkeypatch) -> None:
    import jinja2

    from ctxlaunch.launch import render as render_module

    env = render_module._environment().overlay(
        loader=jinja2.DictLoader({"bad.j2": "echo {{ value }}\n"})
    )
    with pytest.raises(RenderError):
        env.get_template("bad.j2").render(value="$(id)")
    assert env.from_string("echo {{ value | sh }}").render(value="$(id)") == "echo '$(id)'"


def test_templates_ship_inside_the_wheel(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode and "hatchling" in result.stderr:
        pytest.skip("hatchling is not installed in this environment")
    assert result.returncode == 0, result.stderr
    wheel = next(tmp_path.glob("ctxlaunch-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for template in ("slurm.sbatch.j2", "pytorchjob.yaml.j2", "podmonitor.yaml.j2"):
        assert f"ctxlaunch/templates/{template}" in names


@functools.cache
def trainer_validator(crd: Path):
    """A strict validator for one Trainer v2 CRD (read once: the files are near 1 MB)."""
    import jsonschema

    from tests.helpers.crd import pytorchjob_schema

    return jsonschema.Draft7Validator(pytorchjob_schema(crd, "v1alpha1"))


GANGS = [
    [],
    ["cluster.kubernetes.queue=team-a"],
    [
        "cluster.kubernetes.scheduler=volcano",
        "cluster.kubernetes.scheduler_queue=gpu",
        "cluster.kubernetes.priority_class=high",
    ],
    [
        "cluster.kubernetes.scheduler=coscheduling",
        "cluster.kubernetes.schedule_timeout_seconds=600",
    ],
]


@pytest.mark.parametrize("sets", GANGS, ids=["plain", "kueue", "volcano", "coscheduling"])
def test_trainjob_and_runtime_validate_against_the_trainer_crds(
    sets: list[str], trainer_crds: dict[str, Path]
) -> None:
    """TrainJob and TrainingRuntime against Trainer v2.3.0's schemas (unknown fields refused),
    and the runtime's pod template is the PyTorchJob's, container name and port aside, and the
    trainer container's access to its TrainJob's status (the variable naming it, the projected
    token mounted there alone)."""
    spec = load_spec(JOBS / "llama3-70b-1m-k8s.yaml", ["cluster.kubernetes.api=trainjob", *sets])
    runtime, trainjob = trainjob_docs(render(spec, "kubernetes"))
    for doc in (runtime, trainjob):
        validator = trainer_validator(trainer_crds[doc["kind"]])
        errors = sorted(validator.iter_errors(doc), key=str)
        assert not errors, "\n".join(f"{e.message} at {'/'.join(map(str, e.path))}" for e in errors)
    pod = trainjob_pod(runtime)
    legacy = load_spec(JOBS / "llama3-70b-1m-k8s.yaml", sets)
    master = pytorchjob_doc(render(legacy, "kubernetes"))["spec"]["pytorchReplicaSpecs"]["Master"]
    expected = json.loads(json.dumps(master["template"]))
    container = expected["spec"]["containers"][0]
    container["name"] = "node"
    container["ports"][0] = {"name": "rendezvous", "containerPort": 29400}
    container["env"].append({"name": "CTXLAUNCH_TRAINJOB", "value": "llm-training/llama3-70b-1m"})
    container["volumeMounts"].append(
        {
            "name": "trainjob-status",
            "mountPath": "/var/run/secrets/ctxlaunch/trainjob-status",
            "readOnly": True,
        }
    )
    expected["spec"]["volumes"].append(
        {
            "name": "trainjob-status",
            "projected": {
                "sources": [
                    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                    {
                        "configMap": {
                            "name": "kube-root-ca.crt",
                            "items": [{"key": "ca.crt", "path": "ca.crt"}],
                        }
                    },
                ]
            },
        }
    )
    expected["spec"]["restartPolicy"] = "Never"
    assert pod == expected
    # The pod's own token stays unmounted: the status token is in the trainer container only.
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert trainjob["spec"]["trainer"] == {"numNodes": 64, "numProcPerNode": 8}
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    queued = "cluster.kubernetes.queue=team-a" in sets
    assert trainjob["spec"].get("suspend", False) is queued
    assert ("kueue.x-k8s.io/queue-name" in trainjob["metadata"]["labels"]) is queued
    group = runtime["spec"].get("podGroupPolicy", {})
    if "cluster.kubernetes.scheduler=volcano" in sets:
        assert group == {"volcano": {}} and pod["spec"]["schedulerName"] == "volcano"
        assert runtime["spec"]["template"]["metadata"]["annotations"] == {
            "scheduling.volcano.sh/queue-name": "gpu"
        }
    elif "cluster.kubernetes.scheduler=coscheduling" in sets:
        assert group == {"coscheduling": {"scheduleTimeoutSeconds": 600}}
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    else:
        assert group == {} and "schedulerName" not in pod["spec"]
    # The strict schema really refuses unknown fields (so the checks above mean something).
    runtime["spec"]["podGroupPolicy"] = {"kai": {}}
    assert list(trainer_validator(trainer_crds["TrainingRuntime"]).iter_errors(runtime))


@pytest.mark.parametrize("sets", GANGS[1:], ids=["kueue", "volcano", "coscheduling"])
def test_pytorchjob_queue_and_gang_validate_against_the_real_crd(
    sets: list[str], pytorchjob_crd: Path
) -> None:
    spec = load_spec(JOBS / "llama3-70b-1m-k8s.yaml", sets)
    job = pytorchjob_doc(render(spec, "kubernetes"))
    assert not list(crd_validator(pytorchjob_crd).iter_errors(job))
    policy = job["spec"]["runPolicy"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    if "cluster.kubernetes.queue=team-a" in sets:
        assert policy["suspend"] is True and "schedulingPolicy" not in policy
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert "kueue.x-k8s.io/queue-name" not in pod.get("labels", {})
    elif "cluster.kubernetes.scheduler=volcano" in sets:
        assert policy["schedulingPolicy"] == {
            "minAvailable": 64,
            "queue": "gpu",
            "priorityClass": "high",
        }
        assert pod["schedulerName"] == "volcano" and "suspend" not in policy
    else:
        assert policy["schedulingPolicy"] == {"minAvailable": 64, "scheduleTimeoutSeconds": 600}
        assert pod["schedulerName"] == "scheduler-plugins-scheduler"


@pytest.mark.parametrize(
    "sets,field",
    [
        (["cluster.kubernetes.api=jobset"], "cluster.kubernetes.api"),
        (["cluster.kubernetes.scheduler=kai"], "cluster.kubernetes.scheduler"),
        (["cluster.kubernetes.scheduler_queue=gpu"], "cluster.kubernetes"),
        (["cluster.kubernetes.queue=Team_A"], "cluster.kubernetes.queue"),
    ],
)
def test_bad_kubernetes_api_and_gang_settings_name_the_field(sets: list[str], field: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(JOBS / "llama3-70b-1m-k8s.yaml", sets)
    assert f"  - {field} (value:" in str(caught.value), str(caught.value)


def test_a_function_job_has_the_batch_scripts_slurm_options(tmp_path: Path) -> None:
    """A function job (the calibration, through submitit) asks Slurm for what the batch script
    asks, from the same option list: only its nodes and tasks (one node, the entry's ranks) and
    its log (submitit's folder) differ, and the time-limit signal is submitit's own, with the
    batch script's lead. submitit's own batch script carries every one of them."""
    from submitit.slurm.slurm import _make_sbatch_string  # what SlurmExecutor.submit writes

    from ctxlaunch.contract.rundir import calibration_entry
    from ctxlaunch.launch.request import sbatch_flags, slurm_function_request, slurm_request

    def shared(flags: list[str]) -> list[str]:
        return [flag for flag in flags if not flag.startswith(("--nodes=", "--ntasks-per-node="))]

    for overrides in (
        [],
        [
            "cluster.slurm.requeue=false",
            "cluster.slurm.signal_seconds=300",
            "cluster.slurm.mem=512G",
        ],
    ):
        spec = load_spec(JOBS / "llama3-8b-128k-slurm.yaml", overrides)
        script = [f for f in slurm_request(spec).directives if not f.startswith("--output=")]
        function = slurm_function_request(spec, calibration_entry(None))
        flags = [f for f in sbatch_flags(function.options) if not f.startswith("--output=")]
        assert shared(flags) == shared(script)
        assert (function.options["nodes"], function.options["ntasks-per-node"]) == (1, 1)
        text = _make_sbatch_string(
            command="true", folder=tmp_path, setup=function.setup, **function.parameters
        )
        lines = [line.removeprefix("#SBATCH ") for line in text.splitlines() if "#SBATCH" in line]
        for flag in shared(script):
            if flag.startswith("--signal="):
                # submitit's runner gets its own signal (never the B: batch shell's), as early
                lead = flag.rpartition("@")[2]
                signals = [line for line in lines if line.startswith("--signal=")]
                assert len(signals) == 1 and signals[0].endswith(f"@{lead}"), signals
                assert not signals[0].startswith("--signal=B:"), signals
            else:
                assert lines.count(flag) == 1, (flag, lines)
        assert ("--no-requeue" in lines) == ("cluster.slurm.requeue=false" in overrides)
        assert "--ntasks-per-node=1" in lines and "--nodes=1" in lines
