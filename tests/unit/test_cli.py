"""The command line: exit statuses, no partial outputs, and fuzzing with random specs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxlaunch.cli import app
from tests.helpers.cli import CliRunner
from tests.helpers.paths import GOLDEN, JOBS

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=True)


def test_validate_ok_and_invalid() -> None:
    result = run("validate", str(JOBS / "llama3-8b-128k-slurm.yaml"))
    assert result.exit_code == 0, result.output
    assert "ok: llama3-8b-128k" in result.output
    result = run("validate", str(JOBS / "invalid-ulysses-gqa.yaml"))
    assert result.exit_code == 2
    golden = (GOLDEN / "invalid-ulysses-gqa" / "error.txt").read_text()
    assert golden.split(":", 1)[1] in result.stderr


def test_validate_reports_the_old_name_parallel_layout(tmp_path: Path) -> None:
    """A spec that spells parallel.cp_sharding by its old name, parallel.layout, is valid (exit
    0) and `validate` says how to write it now, in its warnings and in its JSON."""
    data = yaml.safe_load((JOBS / "demo.yaml").read_text())
    data["parallel"]["layout"] = data["parallel"].pop("cp_sharding")
    path = tmp_path / "old-name.yaml"
    path.write_text(yaml.safe_dump(data))
    deprecation = "parallel.layout is deprecated: write parallel.cp_sharding (the same values)"
    with pytest.warns(DeprecationWarning, match=re.escape(deprecation)):
        result = run("validate", str(path))
    assert result.exit_code == 0, result.output
    assert f"warning: {deprecation}" in " ".join(result.stderr.split())
    with pytest.warns(DeprecationWarning, match=re.escape(deprecation)):
        result = run("validate", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert deprecation in json.loads(result.stdout)["warnings"]


def test_console_script_exits_2_on_bad_spec(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: tiny\ntraining: {seq_len: 100}\nparallel: {cp: 3}\n")
    exe = Path(sys.executable).parent / "ctxlaunch"
    result = subprocess.run([str(exe), "validate", str(bad)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "parallel" in result.stderr and "Traceback" not in result.stderr


def test_plan_json_is_machine_readable() -> None:
    result = run("plan", str(JOBS / "llama3-8b-128k-slurm.yaml"), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["memory"]["fits"] is True and data["smallest_fitting_cp"] == 8
    assert set(data["flops"]["per_token"]) == {"full", "causal"}


def test_plan_names_the_peak_phase_and_its_parts() -> None:
    """`plan` (text and --json) names the phase of the step that is the peak, with its parts
    adding up to its total, and the estimate never plans below it."""
    path = str(JOBS / "llama3-8b-128k-slurm.yaml")
    data = json.loads(run("plan", path, "--json").stdout)
    phases = data["memory_phases"]["phases"]
    names = [p["name"] for p in phases]
    assert names[:4] == ["forward", "loss", "loss (micro-batch 2 of 4)", "block backward"], names
    assert names[-1] == "optimizer step", names
    top = max(phases, key=lambda p: p["total_bytes"])
    assert data["memory_phases"]["peak"] == top["name"]
    for p in phases:
        parts = sum(v for k, v in p.items() if k.endswith("_bytes") and k != "total_bytes")
        assert abs(parts - p["total_bytes"]) <= 5, p  # each part rounded to whole bytes
    memory = data["memory"]
    assert memory["total_bytes"] - memory["allowance_bytes"] >= top["total_bytes"]
    text = run("plan", path).stdout
    assert "phase by phase" in text and f"{top['name']} (peak)" in text


def test_plan_table_names_both_conventions() -> None:
    result = run("plan", str(JOBS / "llama3-8b-128k-slurm.yaml"))
    assert result.exit_code == 0
    assert "fits:" in result.stdout and "Megatron-LM" in result.stdout
    assert "torchtitan" in result.stdout


def test_plan_with_overrides_reports_no_fit() -> None:
    result = run(
        "plan",
        str(JOBS / "llama3-8b-128k-slurm.yaml"),
        "--set",
        "parallel.cp=1",
        "--set",
        "training.global_batch=null",
    )
    assert result.exit_code == 0
    assert "does not fit" in result.stdout


def test_render_writes_atomically_into_a_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("render", str(JOBS / "llama3-8b-128k-slurm.yaml"), "-t", "slurm", "-o", str(out))
    assert result.exit_code == 0, result.output
    script = out / "llama3-8b-128k.sbatch"
    assert (
        script.read_text()
        == (GOLDEN / "llama3-8b-128k-slurm" / "llama3-8b-128k.sbatch").read_text()
    )
    assert os.access(script, os.X_OK)
    assert [p.name for p in out.iterdir()] == ["llama3-8b-128k.sbatch"]  # no temp files left


def test_render_puts_the_pod_monitor_in_its_own_folder(tmp_path: Path) -> None:
    spec = str(JOBS / "llama3-70b-1m-k8s.yaml")
    printed = run("render", spec, "-t", "kubernetes")
    assert printed.exit_code == 0 and "kind: PodMonitor" not in printed.stdout
    assert (
        "monitoring/llama3-70b-1m-podmonitor.yaml (the PodMonitor) is written only with "
        "--output" in printed.stderr
    )
    out = tmp_path / "out"
    assert run("render", spec, "-t", "kubernetes", "-o", str(out)).exit_code == 0
    golden = GOLDEN / "llama3-70b-1m-k8s"
    for name in ("llama3-70b-1m.yaml", "monitoring/llama3-70b-1m-podmonitor.yaml"):
        assert (out / name).read_text() == (golden / name).read_text()
    assert sorted(p.name for p in out.rglob("*")) == [
        "llama3-70b-1m-podmonitor.yaml",
        "llama3-70b-1m.yaml",
        "monitoring",
    ]


def test_render_invalid_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("render", str(JOBS / "invalid-ulysses-gqa.yaml"), "-t", "slurm", "-o", str(out))
    assert result.exit_code == 2
    assert not out.exists()
    result = run("render", str(JOBS / "demo.yaml"), "-t", "kubernetes", "-o", str(out))
    assert result.exit_code == 2 and "cluster.kubernetes.image" in result.stderr
    assert not out.exists()
    result = run("render", str(JOBS / "demo.yaml"), "-t", "nomad")
    assert result.exit_code == 2 and "--target" in result.stderr


def test_schema_is_json_schema() -> None:
    import jsonschema

    result = run("schema")
    schema = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in JOBS.glob("*.yaml"):
        validator.validate(yaml.safe_load(path.read_text()))
    assert not validator.is_valid({"name": "x", "model": {"layers": 2}, "training": {"seq_len": 8}})
    assert not validator.is_valid(
        {"name": "x", "model": "tiny", "training": {"seq_len": 8}, "typo": 1}
    )


# --------------------------------------------------------------------------------------------
# fuzzing: never a traceback, never a partial output
# --------------------------------------------------------------------------------------------
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 1 << 20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
small = st.integers(min_value=0, max_value=64)

specs = st.fixed_dictionaries(
    {
        "name": st.one_of(st.sampled_from(["job", "x-1", "a"]), st.text(max_size=60)),
        "model": st.one_of(
            st.sampled_from(["tiny", "llama3-8b", "llama3-70b", "nope"]),
            st.fixed_dictionaries(
                {"preset": st.sampled_from(["tiny", "small", "llama3-8b"])},
                optional={
                    "layers": small,
                    "heads": small,
                    "kv_heads": small,
                    "hidden": small,
                    "dtype": st.sampled_from(["bf16", "fp32", "fp8"]),
                },
            ),
        ),
        "training": st.fixed_dictionaries(
            {"seq_len": st.one_of(st.integers(-1, 1 << 21), scalars)},
            optional={
                "micro_batch": small,
                "global_batch": small,
                "grad_accum": small,
                "zero_stage": st.integers(-1, 4),
                "activation_checkpointing": st.sampled_from(["none", "full", "x"]),
            },
        ),
        "parallel": st.fixed_dictionaries(
            {},
            optional={
                "tp": small,
                "pp": small,
                "cp": small,
                "dp": small,
                "ep": small,
                "cp_algorithm": st.sampled_from(["ring", "ulysses", "hybrid", "x"]),
                "ulysses_degree": small,
                "ring_degree": small,
                "cp_sharding": st.sampled_from(["zigzag", "contiguous", "x"]),
            },
        ),
        "cluster": st.fixed_dictionaries(
            {},
            optional={
                "target": st.sampled_from(["local", "slurm", "kubernetes", "x"]),
                "nodes": small,
                "gpus_per_node": small,
                "gpu": st.sampled_from(["H100", "L40S", "cpu", "Z"]),
                "kubernetes": st.fixed_dictionaries(
                    {}, optional={"image": st.text(max_size=20), "namespace": st.text(max_size=20)}
                ),
                "slurm": st.fixed_dictionaries(
                    {},
                    optional={
                        "partition": st.text(max_size=10),
                        "time_limit": st.text(max_size=10),
                    },
                ),
            },
        ),
        "fabric": st.fixed_dictionaries(
            {},
            optional={
                "env": st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
                "hcas": st.lists(st.text(max_size=8), max_size=3),
            },
        ),
    },
    optional={"unknown": scalars},
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=specs, target=st.sampled_from(["slurm", "kubernetes"]))
def test_random_specs_never_traceback_nor_half_write(
    data: dict, target: str, tmp_path_factory
) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    out = tmp / "out"
    for args in (
        ["validate", str(spec)],
        ["plan", str(spec), "--json"],
        ["render", str(spec), "-t", target, "-o", str(out)],
    ):
        result = run(*args)
        assert result.exit_code in (0, 2), (args, result.output, result.exception)
        if result.exception is not None:
            assert isinstance(result.exception, SystemExit), repr(result.exception)
        if result.exit_code == 2:
            assert "invalid spec" in result.stderr or "error:" in result.stderr
    files = list(out.iterdir()) if out.exists() else []
    assert all(not f.name.startswith(".") for f in files)  # no temp file left behind
    if files:
        assert len(files) == 1 and files[0].stat().st_size > 0


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_random_text_is_rejected_cleanly(text: str, tmp_path_factory) -> None:
    spec = tmp_path_factory.mktemp("text") / "spec.yaml"
    spec.write_text(text)
    result = run("validate", str(spec))
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@settings(max_examples=100, deadline=None)
@given(overrides=st.lists(st.text(max_size=30), max_size=4))
def test_random_overrides_are_rejected_cleanly(overrides: list[str]) -> None:
    args = ["validate", str(JOBS / "demo.yaml")]
    for item in overrides:
        args += ["--set", item]
    result = run(*args)
    assert result.exit_code in (0, 2), (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)


FREE_TEXT_FIELDS = [
    "name",
    "fabric.env.USER_VALUE",
    "fabric.nccl.NCCL_ALGO",
    "fabric.topo_file",
    "fabric.socket_ifname",
    "training.checkpoint.dir",
    "cluster.slurm.partition",
    "cluster.slurm.account",
    "cluster.kubernetes.image",
    "cluster.kubernetes.namespace",
    "cluster.slurm.time_limit",
]


@settings(max_examples=120, deadline=None)
@given(
    field=st.sampled_from(FREE_TEXT_FIELDS),
    value=st.text(max_size=40),
    target=st.sampled_from(["slurm", "kubernetes"]),
)
def test_random_strings_in_a_valid_spec(
    field: str, value: str, target: str, tmp_path_factory
) -> None:
    tmp = tmp_path_factory.mktemp("strings")
    data = yaml.safe_load((JOBS / "demo.yaml").read_text())
    data["cluster"]["kubernetes"] = {"image": "example/ctxlaunch:1"}
    node = data
    *parents, leaf = field.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    out = tmp / "out"
    result = run("render", str(spec), "-t", target, "-o", str(out))
    assert result.exit_code in (0, 2), (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    if result.exit_code == 2:
        assert not out.exists()
        return
    (artifact,) = list(out.iterdir())
    text = artifact.read_text()
    if target == "slurm":
        assert subprocess.run(["bash", "-n", str(artifact)]).returncode == 0
    else:
        docs = list(yaml.safe_load_all(text))
        assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
