"""Every string that reaches a batch script, a manifest or an environment, tried with hostile
text (hypothesis): line breaks (a trailing one too), NUL, quotes, `$(...)`, backticks, Unicode
line separators, lone surrogates, megabyte strings. Each value is either refused naming its
field, or rendered inert and whole:

- the batch script passes `bash -n` and shellcheck; every `#SBATCH` line stands in the block
  sbatch reads (before the first command) and equals the request's directives; the script's
  exports, run by bash in an empty environment, give exactly the request's environment and
  run nothing (a planted `touch` leaves no file);
- the manifests read back (YAML) to the request's names, labels and environment.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxlaunch.contract.loader import SpecError, validate_spec
from ctxlaunch.contract.rundir import SPEC_ENV, spec_json
from ctxlaunch.launch.render import render_files
from ctxlaunch.launch.request import kubernetes_request, slurm_request
from tests.helpers.paths import JOBS
from tests.helpers.shell import shellcheck

MARKER = Path("/tmp/ctxlaunch-injection-test-ran")
"""What a value that escaped its quoting would create (the hostile samples `touch` it)."""

HOSTILE = [
    "demo\n",
    "gpu\n#SBATCH --partition=evil",
    "x\x00y",
    "a\rb",
    "a\u2028b",
    "a\u0085b",
    "\ud800",
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"'; touch {MARKER}; '",
    f'"; touch {MARKER}; "',
    "${HOME}",
    "a b\tc",
    "=",
    "-x",
    "#",
    "x" * 5000,
    "é中文",
]

texts = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(max_size=24),
    st.text(alphabet="abc-_.=:/$'\"`\\;&|# \n\x00", max_size=16),
    st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True).map(lambda s: s + "\n"),
    st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True),
)

SLURM_FIELDS = [
    "name",
    "cluster.slurm.partition",
    "cluster.slurm.account",
    "cluster.slurm.qos",
    "cluster.slurm.time_limit",
    "cluster.slurm.mem",
    "cluster.slurm.log_dir",
    "fabric.hcas.0",
    "fabric.socket_ifname",
    "fabric.gdr_level",
    "fabric.topo_file",
    "fabric.env.VALUE",
    "fabric.env.<key>",
    "fabric.nccl.NCCL_ALGO",
    "fabric.nccl.<key>",
    "training.checkpoint.dir",
    "telemetry.pushgateway_url",
]
KUBERNETES_FIELDS = [
    "name",
    "cluster.kubernetes.namespace",
    "cluster.kubernetes.image",
    "cluster.kubernetes.service_account",
    "cluster.kubernetes.priority_class",
    "cluster.kubernetes.image_pull_secrets.0",
    "cluster.kubernetes.node_selector.<key>",
    "cluster.kubernetes.node_selector.kubernetes.io/arch",
    "cluster.kubernetes.tolerations.0.key",
    "cluster.kubernetes.tolerations.0.value",
    "cluster.kubernetes.queue",
    "cluster.kubernetes.shm_size",
    "cluster.kubernetes.memory",
    "cluster.kubernetes.rdma_resource",
    "fabric.env.VALUE",
    "fabric.env.<key>",
]


def base(target: str) -> dict[str, Any]:
    name = "llama3-8b-128k-slurm.yaml" if target == "slurm" else "llama3-70b-1m-k8s.yaml"
    return yaml.safe_load((JOBS / name).read_text())


def place(data: dict[str, Any], field: str, value: str) -> None:
    """Set `field` (dotted; a number indexes a list; <key> makes `value` the key) to `value`."""
    *parents, leaf = field.split(".")
    if leaf == "<key>":
        *parents, leaf = parents
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node.setdefault(leaf, {})[value] = "1"
        return
    if field.endswith("node_selector.kubernetes.io/arch"):
        data["cluster"]["kubernetes"]["node_selector"] = {"kubernetes.io/arch": value}
        return
    node: Any = data
    for part in parents:
        if part.isdigit():
            node = node[int(part)]
        else:
            node = node.setdefault(part, [] if part in ("hcas", "image_pull_secrets") else {})
    if leaf.isdigit():
        if len(node) <= int(leaf):
            node.append(value)
        node[int(leaf)] = value
    else:
        node[leaf] = value


def refused_at(field: str, error: SpecError) -> bool:
    """Whether a problem stands at `field` or at the mapping or list that holds it."""
    wanted = field.replace(".<key>", "")
    for problem in error.problems:
        path = problem.path.replace("[", ".").replace("]", "")
        if path and (wanted.startswith(path) or path.startswith(wanted)):
            return True
    return False


def sbatch_block(script: str) -> list[str]:
    """The `#SBATCH` options sbatch reads: those before the first line that is neither a
    comment nor blank."""
    directives = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            directives.append(line[len("#SBATCH ") :])
    return directives


def exported_environment(script: str, tmp: Path) -> dict[str, str]:
    """The environment the script's export section leaves, run by bash from an empty one."""
    head = script.split('\nMASTER_ADDR="$(', 1)[0]
    path = tmp / "exports.sh"
    path.write_text(head + "\nexec env -0\n")
    result = subprocess.run(
        ["env", "-i", f"PATH={os.environ['PATH']}", "bash", str(path)],
        capture_output=True,
        check=True,
    )
    found = dict(item.decode().split("=", 1) for item in result.stdout.split(b"\0") if item)
    for name in ("PATH", "PWD", "SHLVL", "_", "OLDPWD"):
        found.pop(name, None)
    return found


CHECKED = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.mark.parametrize("field", SLURM_FIELDS)
@CHECKED
@given(value=texts)
def test_slurm_values_are_refused_or_land_inert_and_whole(
    field: str, value: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    data = base("slurm")
    place(data, field, value)
    try:
        spec = validate_spec(data)
    except SpecError as exc:
        assert refused_at(field, exc), (field, value, str(exc))
        return
    script = render_files(spec, "slurm")[f"{spec.name}.sbatch"]
    tmp = tmp_path_factory.mktemp("sbatch")
    path = tmp / "job.sbatch"
    path.write_text(script)
    shellcheck(path)
    request = slurm_request(spec)
    assert sbatch_block(script) == request.directives
    assert exported_environment(script, tmp) == {**request.env, SPEC_ENV: spec_json(spec)}
    assert not MARKER.exists()


@pytest.mark.parametrize("field", KUBERNETES_FIELDS)
@CHECKED
@given(value=texts)
def test_kubernetes_values_are_refused_or_read_back_whole(field: str, value: str) -> None:
    data = base("kubernetes")
    place(data, field, value)
    try:
        spec = validate_spec(data)
    except SpecError as exc:
        assert refused_at(field, exc), (field, value, str(exc))
        return
    text = render_files(spec, "kubernetes")[f"{spec.name}.yaml"]
    config_map, job = list(yaml.safe_load_all(text))
    request = kubernetes_request(spec)
    assert config_map["data"] == {"spec.json": request.spec_json}
    assert job["metadata"]["name"] == spec.name
    assert job["metadata"]["namespace"] == request.namespace
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        assert {item["name"]: item.get("value") for item in container["env"]} == request.env
        assert container["image"] == request.image
        assert pod.get("nodeSelector", {}) == request.node_selector
        assert pod.get("tolerations", []) == request.tolerations
        assert replica["template"]["metadata"]["labels"] == request.labels


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("name", "demo\n", "name (value: 'demo\\n'): the value contains a line break"),
        ("fabric.env.<key>", "FOO\n", "fabric.env (value: 'FOO\\n'): the key contains a line"),
        ("cluster.slurm.partition", "gpu\n", "cluster.slurm.partition (value: 'gpu\\n')"),
        ("name", "x" * 10_000_000, "is 10,000,000 characters long"),
    ],
)
def test_the_refusal_names_the_field_and_never_echoes_a_huge_value(
    field: str, value: str, words: str
) -> None:
    data = base("slurm")
    place(data, field, value)
    with pytest.raises(SpecError) as caught:
        validate_spec(data)
    assert words in str(caught.value)
    assert len(str(caught.value)) < 2000
