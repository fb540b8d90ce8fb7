"""What the launcher side reads back, given as a careless user or an attacker would: job and
sweep references that are paths or longer than a file name, job and sweep records and run
files that are damaged (cut short, not UTF-8, of the wrong type, nested without end, a FIFO),
a machine profile or saved calibration that is no file, `fabric.env` naming ctxlaunch's own
variables, sweeps of unbounded size or whose values collide in one name. Each is exit 2 (or
skipped, named) with one sentence naming the file or field, never a traceback or a hang."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from ctxlaunch.cli import app
from ctxlaunch.launch import jobstore
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh CTXLAUNCH_HOME."""
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _invoke(*args: str) -> tuple[int, str]:
    """The command in process: its exit code and its output on one line, after checking it
    raised nothing but an exit and printed no traceback."""
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args,
        result.output,
        result.exception,
    )
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.output.split())


def _local_record(job_id: str, **extra: object) -> jobstore.JobRecord:
    """A finished local job's record, saved in the store."""
    record = jobstore.JobRecord(
        id=job_id,
        name="demo",
        target="local",
        created=time.time(),
        backend_id=job_id,
        extra={"exit_status": 0, "rank_exit_codes": [0, 0], **extra},
    )
    jobstore.save(record)
    return record


def test_a_reference_is_a_name_in_the_store_never_a_path(home: Path, tmp_path: Path) -> None:
    """`status /x/d` read /x/d/job.json and reported whatever it said; a reference longer than
    a file name ended in a traceback."""
    _local_record("local-demo-1")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "job.json").write_text((home / "jobs" / "local-demo-1" / "job.json").read_text())
    for reference in (str(outside), "../../elsewhere", "local-demo-1/.."):
        code, said = _invoke("status", reference)
        assert code == 2 and f"no job {reference!r}" in said, said
    code, said = _invoke("status", "x" * 300)
    assert code == 2 and "a job reference of 300 characters: ids and names are at most 255" in said
    code, said = _invoke("report", "y" * 300)
    assert code == 2 and "a sweep reference of 300 characters" in said, said
    (home / "sweeps").mkdir(parents=True)
    code, said = _invoke("report", f"../{outside.name}")
    assert code == 2 and "no sweep" in said, said


DAMAGE = {
    "cut short": b'{"id": "local-demo-2", "name": "de',
    "not UTF-8": b'{"id": "local-demo-2", "name": "\xff\xfe"}',
    "a list": b"[1, 2, 3]",
    "nested without end": b"[" * 100_000 + b"]" * 100_000,
    "a field of the wrong type": json.dumps(
        {"id": "local-demo-2", "name": "demo", "target": "local", "created": "yesterday"}
    ).encode(),
    "another job's": json.dumps(
        {"id": "local-other", "name": "demo", "target": "local", "created": 1.0}
    ).encode(),
}


@pytest.mark.parametrize("kind", [*sorted(DAMAGE), "a FIFO"])
def test_a_damaged_job_record_is_named_by_status_and_skipped_by_list(kind: str, home: Path) -> None:
    """`status` of a damaged record is exit 2 naming its file; `list` names it and lists every
    other job (one bad record stopped `list` for every job)."""
    _local_record("local-demo-1")
    directory = home / "jobs" / "local-demo-2"
    directory.mkdir(parents=True)
    if kind == "a FIFO":
        os.mkfifo(directory / "job.json")
    else:
        (directory / "job.json").write_bytes(DAMAGE[kind])
    code, said = _invoke("status", "local-demo-2")
    assert code == 2 and f"damaged job record {directory / 'job.json'}" in said, said
    code, said = _invoke("list")
    assert code == 0 and "local-demo-1" in said, said
    assert f"warning: damaged job record {directory / 'job.json'}" in said, said


def _sweep_record(home: Path, job: str | None) -> Path:
    """A sweep record of one point (the demo), run as `job`."""
    from ctxlaunch.contract.loader import load_spec

    spec = load_spec(JOBS / "demo.yaml").model_dump(mode="json")
    data = {
        "id": "sweep-demo-1",
        "name": "demo",
        "target": "local",
        "created": 1.0,
        "axes": ["training.seq_len"],
        "points": [
            {
                "index": 0,
                "name": "demo-8192",
                "values": {"training.seq_len": 8192},
                "job": job,
                "skipped": None,
                "spec": spec,
            },
        ],
    }
    return jobstore.save_sweep("sweep-demo-1", data)


def test_report_names_damaged_run_files_and_leaves_their_columns_empty(home: Path) -> None:
    """A point's summary.json cut short and its eval.jsonl of lines ctxlaunch did not write:
    `report` names each file and reports the rest (it ended in a traceback)."""
    record = _local_record("local-demo-8192")
    (record.directory / "summary.json").write_text('{"tokens_per_second_per_gpu": 12')
    (record.directory / "eval.jsonl").write_text('{"loss": "low", "buckets": 3}\n')
    _sweep_record(home, record.id)
    code, said = _invoke("report", "sweep-demo-1", "--json")
    assert code == 0, said
    assert (
        f"warning: {record.directory / 'summary.json'}: the run's summary is not valid JSON" in said
    )
    assert f"warning: {record.directory / 'eval.jsonl'}: the last line is not an evaluation" in said
    assert '"name": "demo-8192"' in said and '"state": "COMPLETED"' in said


def test_report_of_a_damaged_sweep_record_is_one_sentence(home: Path) -> None:
    path = _sweep_record(home, None)
    data = json.loads(path.read_text())
    data["points"][0]["values"] = "8192"
    path.write_text(json.dumps(data))
    code, said = _invoke("report", "sweep-demo-1")
    assert code == 2, said
    assert f"damaged sweep record {path}: points[0] is not a point" in said, said
    path.write_bytes(b"\xff" * 10)
    code, said = _invoke("report", "sweep-demo-1")
    assert code == 2 and f"damaged sweep record {path}: the sweep record is not UTF-8" in said


def test_a_local_jobs_events_file_that_is_no_file_does_not_hang_status(home: Path) -> None:
    """events.jsonl is read with bounds: a FIFO there (which blocked `status` for ever) reads
    as no events."""
    record = _local_record("local-demo-3")
    os.mkfifo(record.directory / "events.jsonl")
    code, said = _invoke("status", "local-demo-3")
    assert code == 0 and "local-demo-3: COMPLETED" in said, said


@pytest.mark.parametrize(
    ("section", "name"),
    [
        ("env", "CTXLAUNCH_SPEC_JSON"),
        ("env", "CTXLAUNCH_RUN_DIR"),
        ("env", "CTXLAUNCH_INJECT_FAULT"),
        ("nccl", "MASTER_ADDR"),
        ("env", "RANK"),
        ("env", "TORCHELASTIC_RUN_ID"),
        ("env", "PET_NNODES"),
    ],
)
def test_fabric_env_cannot_set_the_launchers_own_variables(section: str, name: str) -> None:
    """A user's CTXLAUNCH_SPEC_JSON was exported after the validated one, so the ranks ran a
    spec `validate` never saw; the run directory, the fault hook and the rendezvous could be
    set the same way."""
    code, said = _invoke(
        "validate", str(JOBS / "demo.yaml"), "--set", f"fabric.{section}={{{name}: x}}"
    )
    assert code == 2 and f"fabric.{section}" in said and f"{name!r} is " in said, said
    assert "choose another name" in said


@pytest.mark.parametrize(
    "name", ["CTXLAUNCH_ATTENTION_KERNEL", "CTXLAUNCH_MASKED_ATTENTION", "CTXLAUNCH_CP_FUSED_MERGE"]
)
def test_fabric_env_may_carry_the_attention_switches(name: str) -> None:
    """The switches the ranks read and no launcher sets stay settable, so a pod can get them."""
    code, said = _invoke("validate", str(JOBS / "demo.yaml"), "--set", f"fabric.env={{{name}: x}}")
    assert code == 0, said


def test_the_batch_script_exports_ctxlaunchs_own_variables_after_the_specs() -> None:
    """Whatever the spec's environment holds, the validated spec comes after it."""
    code, text = _invoke(
        "render", str(JOBS / "demo.yaml"), "-t", "slurm", "--set", "fabric.env={MY_FLAG: '1'}"
    )
    assert code == 0
    assert text.index("export MY_FLAG=1") < text.index("export CTXLAUNCH_SPEC_JSON=")


def test_a_pods_run_directory_is_a_field_not_an_environment_variable() -> None:
    """On Kubernetes the run directory went on a volume through fabric.env's
    CTXLAUNCH_RUN_DIR, now refused: cluster.kubernetes.run_dir says it, and the pods get it
    after the spec's environment."""
    code, text = _invoke(
        "render",
        str(JOBS / "llama3-70b-1m-k8s.yaml"),
        "--set",
        "cluster.kubernetes.run_dir=/checkpoints/run",
        "--set",
        "fabric.env={MY_FLAG: '1'}",
    )
    assert code == 0, text
    first = text.index('name: "MY_FLAG"')
    assert first < text.index('name: "CTXLAUNCH_RUN_DIR" value: "/checkpoints/run"')


def test_a_machine_profile_or_calibration_that_is_no_file_is_named(
    home: Path, tmp_path: Path
) -> None:
    """cluster.profile and the saved CPU calibration are read with bounds: a FIFO (which
    blocked), nesting without end, a constant of the wrong type (which reached `plan`'s
    arithmetic) are named; a damaged saved calibration is not used."""
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    code, said = _invoke("validate", str(JOBS / "demo.yaml"), "--set", f"cluster.profile={fifo}")
    assert code == 2 and "the machine profile is a FIFO; give a regular file" in said, said
    typed = tmp_path / "typed.json"
    typed.write_text(
        json.dumps(
            {
                "format": "ctxlaunch-machine-profile/1",
                "gpu": "cpu",
                "fabric": "infiniband-ndr",
                "kind": "cpu",
                "calibration": {"matmul_flops_per_second": "fast"},
            }
        )
    )
    code, said = _invoke("plan", str(JOBS / "demo.yaml"), "--set", f"cluster.profile={typed}")
    assert code == 2 and f"{typed} is not a machine profile" in said, said
    assert "matmul_flops_per_second is a str" in said
    home.mkdir(parents=True, exist_ok=True)
    os.mkfifo(home / "calibration.json")
    code, said = _invoke("plan", str(JOBS / "demo.yaml"))
    assert code == 0, said


def test_a_sweep_of_more_points_than_a_sweep_holds_is_refused_before_expanding(
    tmp_path: Path,
) -> None:
    """8 axes of 10 values ran `sweep --dry-run` for ever; the product is stated first."""
    axes = {
        f"model.{name}": list(range(1, 11))
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "head_dim")
    }
    axes["training.steps"] = list(range(1, 11))
    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump({"sweep": {"name": "big", "base": str(JOBS / "demo.yaml"), "axes": axes}})
    )
    code, said = _invoke("sweep", str(path), "--dry-run")
    assert code == 2, said
    assert "10 x 10 x 10 x 10 x 10 x 10 x 10 x 10 values make 100,000,000 points" in said
    assert "at most 1,000" in said


def test_sweep_points_have_distinct_names_and_their_own_checkpoint_directories(
    tmp_path: Path,
) -> None:
    """`a-b`, `a_b` and `A B` all became `p-a-b`, and every point shared the base's checkpoint
    directory (point 2 resumed from point 1's last step and trained nothing). Names are now
    distinct, plain values read back from the name, and each point checkpoints in
    `<base dir>/<point name>`."""
    from ctxlaunch.launch.sweep import load_sweep

    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "sweep": {
                    "name": "p",
                    "base": str(JOBS / "demo.yaml"),
                    "set": {"training.checkpoint.dir": str(tmp_path / "ckpt")},
                    "axes": {
                        "fabric.socket_ifname": ["a-b", "a_b", "A B", "ab"],
                        "training.steps": [10, 20],
                    },
                }
            }
        )
    )
    _, points = load_sweep(path)
    names = [point.name for point in points]
    assert len(set(names)) == len(names) == 8
    assert "p-ab-10" in names and "p-ab-20" in names  # plain values, as they are
    for point in points:
        assert point.spec is not None
        assert point.spec.training.checkpoint.dir == str(tmp_path / "ckpt" / point.name)
    code, said = _invoke("sweep", str(path), "--dry-run", "--set", ".".join(["a"] * 2000) + "=1")
    assert code == 2 and "a path of 2,000 parts" in said, said
