"""Sweeps: expansion with stable names, invalid points reported with the spec's reason,
grouping into job arrays by shared resources, the array script, and a local sweep's report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ctxlaunch.launch.render import render_request
from ctxlaunch.launch.request import slurm_request
from ctxlaunch.launch.sweep import load_sweep, point_name, slurm_groups
from tests.helpers.paths import JOBS
from tests.helpers.shell import shellcheck

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")


def write_sweep(tmp_path: Path, axes: dict, extra_set: dict | None = None) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "sweep": {
                    "name": "sw",
                    "base": str(JOBS / "demo.yaml"),
                    "set": {
                        "training.steps": 2,
                        "training.checkpoint.dir": None,
                        **(extra_set or {}),
                    },
                    "axes": axes,
                }
            },
            sort_keys=False,
        )
    )
    return path


def test_expansion_is_the_cartesian_product_with_stable_names(tmp_path: Path) -> None:
    definition, points = load_sweep(
        write_sweep(
            tmp_path,
            {"training.seq_len": [1024, 2048], "parallel.cp_algorithm": ["ring", "ulysses"]},
        )
    )
    assert [p.name for p in points] == [
        "sw-1024-ring",
        "sw-1024-ulysses",
        "sw-2048-ring",
        "sw-2048-ulysses",
    ]
    assert all(p.spec is not None for p in points)
    assert points[3].spec.training.seq_len == 2048
    assert points[3].spec.parallel.cp_algorithm == "ulysses"
    assert points[3].spec.training.steps == 2  # the sweep's `set`
    again = load_sweep(write_sweep(tmp_path, definition.axes))[1]
    assert [p.name for p in again] == [p.name for p in points]
    long = point_name("sw", tuple(["x" * 30, "y" * 30]))
    assert len(long) <= 48 and long == point_name("sw", tuple(["x" * 30, "y" * 30]))


def test_invalid_points_carry_the_specs_reason(tmp_path: Path) -> None:
    _, points = load_sweep(write_sweep(tmp_path, {"training.seq_len": [1024, 1001]}))
    assert points[0].spec is not None
    assert points[1].spec is None and "training.seq_len" in points[1].problem
    assert "2 x cp = 4" in points[1].problem


def test_points_that_share_resources_form_one_array(tmp_path: Path) -> None:
    _, points = load_sweep(
        write_sweep(
            tmp_path,
            {"training.seq_len": [1024, 2048], "cluster.gpus_per_node": [2, 4]},
            {"cluster.target": "slurm", "parallel.dp": None},
        )
    )
    groups = slurm_groups(points)
    assert sorted(len(g) for g in groups) == [2, 2]
    for group in groups:
        assert len({p.spec.cluster.gpus_per_node for p in group}) == 1


def test_the_array_script_runs_each_tasks_spec(tmp_path: Path) -> None:
    _, points = load_sweep(
        write_sweep(tmp_path, {"training.seq_len": [1024, 2048]}, {"cluster.target": "slurm"})
    )
    specs = [p.spec for p in points]
    request = slurm_request(
        specs[0], run_dir="/runs/sw", log_dir="/logs", array=specs, job_name="sw"
    )
    text = render_request(request, "slurm", "sw.sbatch")
    assert "#SBATCH --array=0-1" in text and "#SBATCH --output=/logs/%x-%A_%a.out" in text
    assert "#SBATCH --job-name=sw" in text
    assert 'export CTXLAUNCH_RUN_DIR=/runs/sw/"${SLURM_ARRAY_TASK_ID}"' in text
    script = tmp_path / "sw.sbatch"
    script.write_text(text)
    shellcheck(script)
    # Each task id selects its own spec: run the selection part of the script in bash.
    start = text.index('case "${SLURM_ARRAY_TASK_ID}"')
    selection = text[start : text.index("esac", start) + 4]
    for task, spec in enumerate(specs):
        out = subprocess.run(
            ["bash", "-c", selection + '\nprintf %s "$CTXLAUNCH_SPEC_JSON"'],
            env={"SLURM_ARRAY_TASK_ID": str(task), "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(out)["training"]["seq_len"] == spec.training.seq_len
        assert json.loads(out)["name"] == spec.name


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_local_sweep_runs_every_point_and_reports(tmp_path: Path) -> None:
    sweep_file = write_sweep(tmp_path, {"training.seq_len": [512, 1001, 1024]})
    env = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")}
    env.pop("CTXLAUNCH_INJECT_FAULT", None)
    result = subprocess.run(
        [CTXLAUNCH, "sweep", str(sweep_file)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 points, 2 to run" in result.stderr
    sweep_id = result.stdout.strip().splitlines()[-1]
    report = subprocess.run(
        [
            CTXLAUNCH,
            "report",
            sweep_id,
            "--json",
            "--csv",
            str(tmp_path / "r.csv"),
            "--plots",
            str(tmp_path / "plots"),
            "--html",
            str(tmp_path / "r.html"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["rows"]
    assert [r["state"] for r in rows] == ["COMPLETED", "SKIPPED", "COMPLETED"]
    assert all(r["tokens_per_second_per_gpu"] > 0 for r in rows if r["state"] == "COMPLETED")
    assert (tmp_path / "r.csv").read_text().startswith("name,training.seq_len,state,")
    # Predicted beside measured, for every point that ran.
    for row in (r for r in rows if r["state"] == "COMPLETED"):
        assert row["predicted_step_seconds"] > 0 and row["predicted_peak_memory_gib"] > 0
        assert row["step_error"] == pytest.approx(
            row["predicted_step_seconds"] / row["step_seconds"] - 1
        )
        assert row["mfu_causal"] > 0 and row["predicted_mfu_full"] > row["predicted_mfu_causal"]
        # The CP group's busiest/mean attention area, from the run's summary.
        assert row["attention_balance"] >= 1.0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["memory.png", "mfu.png", "throughput.png"]
    assert all((tmp_path / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in pngs)
    page = (tmp_path / "r.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and 'src="http' not in page


def test_bad_sweep_files_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("sweep:\n  name: Bad_Name\n  base: x.yaml\n  axes: {}\n")
    result = subprocess.run(
        [CTXLAUNCH, "sweep", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "sweep.name" in result.stderr and "sweep.axes" in result.stderr


def test_example_sweep_golden(check_golden) -> None:
    _, points = load_sweep(JOBS / "sweeps" / "demo.yaml", ["cluster.target=slurm"])
    (group,) = slurm_groups(points)
    specs = [p.spec for p in group]
    request = slurm_request(
        specs[0], run_dir="runs/demo-sweep", log_dir=".", array=specs, job_name="demo-sweep"
    )
    check_golden(
        "sweeps/demo/demo-sweep.sbatch", render_request(request, "slurm", "demo-sweep.sbatch")
    )


def test_report_plots_one_series_per_layout() -> None:
    # TP and PP points get lines of their own, not the CP 1 line of the same length.
    from ctxlaunch.launch.report import _series

    def row(seq: int, cp: int = 1, algorithm: str = "ring", tp: int = 1, pp: int = 1) -> dict:
        return {
            "seq_len": seq,
            "cp": cp,
            "cp_algorithm": algorithm,
            "tp": tp,
            "pp": pp,
            "predicted_step_seconds": 1.0,
        }

    rows = [
        row(8192),
        row(4096),
        row(4096, tp=2),
        row(4096, pp=2),
        row(4096, cp=2),
        row(4096, cp=4, algorithm="hybrid", tp=2),
    ]
    series = _series(rows)
    assert set(series) == {("cp 1", 1), ("pp 2", 1), ("tp 2", 1), ("ring", 2), ("tp 2, hybrid", 4)}
    assert [r["seq_len"] for r in series[("cp 1", 1)]] == [4096, 8192]
