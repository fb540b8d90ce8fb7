"""Slurm end to end on the real cluster with accounting (scripts/services/slurm.sh; these jobs
run on this host's node, the faults on the namespaced nodes are in test_slurm_faults.py):
submit, watch, read logs, cancel, failures and OOMs, preemption with requeue and resume, plain
sbatch of the rendered script, and bad input. Every test has a timeout."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.paths import JOBS
from tests.helpers.services import PUSHGATEWAY_URL, poll, require_prometheus
from tests.helpers.slurm_jobs import (
    BIN,
    CTXLAUNCH,
    FIRST_RUN_SLOW,
    QUICK,
    ctx,
    final_loss,
    run,
    status,
    submit,
    wait_for,
    wait_for_log,
)

pytestmark = [pytest.mark.usefixtures("slurm"), pytest.mark.service_group("slurm_host")]


@pytest.mark.timeout(300)
def test_demo_completes_with_logs_and_metrics_in_prometheus(tmp_path: Path, home: Path) -> None:
    require_prometheus()
    name = f"slurm-{uuid.uuid4().hex[:8]}"
    job_id = submit(
        tmp_path,
        home,
        f"name={name}",
        "training.steps=4",
        "telemetry.prometheus=push",
        f"telemetry.pushgateway_url={PUSHGATEWAY_URL}",
        "telemetry.push_interval_seconds=1",
    )
    # --follow streams the log from submission until the job is over, then returns.
    followed = ctx(home, tmp_path, "logs", job_id, "--follow", "--rank", "0", timeout=170)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.splitlines()[-1].startswith("ctxlaunch: done: 4 steps")
    assert "step 1/4" in followed.stdout and "step 4/4  100%, 0 s left" in followed.stdout
    waited = ctx(home, tmp_path, "wait", job_id, "--timeout", "150", "--poll", "0.5", timeout=170)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert f"{job_id}: COMPLETED" in waited.stdout
    final = status(home, tmp_path, job_id)
    assert final["state"] == "COMPLETED" and final["restarts"] == 0
    # Measured against its plan, from the run's files on the shared filesystem.
    measured = final["measured"]
    assert measured["step"] == measured["steps"] == 4 and measured["remaining_seconds"] == 0
    assert {f["name"]: f["measured"] > 0 for f in measured["figures"]} == dict.fromkeys(
        ["step time", "peak memory", "MFU causal", "MFU full", "tokens/s/GPU"], True
    )
    log = ctx(home, tmp_path, "logs", job_id).stdout
    assert "0: ctxlaunch: done: 4 steps" in log and "2 ranks (slurm)" in log
    rank0 = ctx(home, tmp_path, "logs", job_id, "--rank", "0").stdout
    assert rank0.splitlines()[-1].startswith("ctxlaunch: done: 4 steps")
    # The job's metrics went through the Pushgateway into Prometheus, both ranks, final step.
    found = poll(f'ctxlaunch_last_step{{job="{name}", run="{job_id}"}} == 4', lambda r: len(r) == 2)
    assert {s["metric"]["rank"] for s in found} == {"0", "1"}
    listed = ctx(home, tmp_path, "list").stdout
    assert job_id in listed and "COMPLETED" in listed


@pytest.mark.timeout(300)
def test_the_rendered_script_runs_with_plain_sbatch(tmp_path: Path, home: Path) -> None:
    sets = [
        f"training.checkpoint.dir={tmp_path / 'ckpt'}",
        "training.steps=3",
        *[s for s in QUICK if not s.startswith("cluster.target")],
    ]
    args = [CTXLAUNCH, "render", str(JOBS / "demo.yaml"), "-t", "slurm", "-o", str(tmp_path)]
    for item in sets:
        args += ["--set", item]
    rendered = run(args, home, tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    # The script starts `python3`: the submitter's environment (this venv first) travels with
    # the job, as it does for a user with an activated venv.
    env_path = f"{BIN}:{os.environ['PATH']}"
    sbatch = run(
        ["sbatch", "--parsable", str(tmp_path / "demo.sbatch")], home, tmp_path, PATH=env_path
    )
    assert sbatch.returncode == 0, sbatch.stderr
    job_id = sbatch.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 150
    while True:
        state = run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], home, tmp_path
        ).stdout.strip()
        if state in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        assert time.monotonic() < deadline, f"plain sbatch job {job_id}: {state}"
        time.sleep(0.5)
    output = (tmp_path / f"demo-{job_id}.out").read_text()
    assert state == "COMPLETED", output
    assert "0: ctxlaunch: done: 3 steps" in output


@pytest.mark.timeout(180)
def test_cancel_ends_a_running_job_within_seconds(tmp_path: Path, home: Path) -> None:
    job_id = submit(tmp_path, home, "training.steps=100000")
    wait_for_log(home, job_id, r"^0: step 2/")
    cancelled = ctx(home, tmp_path, "cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    final = wait_for(home, job_id, {"CANCELLED", "COMPLETED", "FAILED"}, timeout=20)
    assert final["state"] == "CANCELLED"


@pytest.mark.timeout(240)
def test_a_failing_trainer_reports_failed_with_the_failing_ranks_log(
    tmp_path: Path, home: Path
) -> None:
    job_id = submit(
        tmp_path, home, "training.steps=20", CTXLAUNCH_INJECT_FAULT="kind=error,rank=1,step=2"
    )
    waited = ctx(home, tmp_path, "wait", job_id, "--timeout", "150", "--poll", "0.5", timeout=170)
    assert waited.returncode == 1, waited.stdout
    assert f"{job_id}: FAILED" in waited.stdout
    assert "rank 1 failed; its last lines:" in waited.stdout
    assert "injected by CTXLAUNCH_INJECT_FAULT: failure on rank 1 at step 2" in waited.stdout


@pytest.mark.timeout(240)
def test_an_injected_oom_reports_oom_with_the_layout(tmp_path: Path, home: Path) -> None:
    job_id = submit(
        tmp_path, home, "training.steps=20", CTXLAUNCH_INJECT_FAULT="kind=oom,rank=0,step=2"
    )
    waited = ctx(home, tmp_path, "wait", job_id, "--timeout", "150", "--poll", "0.5", timeout=170)
    assert waited.returncode == 86, waited.stdout + waited.stderr
    assert f"{job_id}: OOM" in waited.stdout
    assert (
        "out of device memory with model tiny, seq_len 1024, cp 2 (ring, zigzag)" in waited.stdout
    )
    assert "out of memory on rank 0 at step 2: the planner predicted" in waited.stdout


@pytest.mark.timeout(420)
def test_preemption_checkpoints_requeues_resumes_and_matches(tmp_path: Path, home: Path) -> None:
    steps = ["training.steps=30", "training.checkpoint.interval=1000"]
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight = submit(straight_dir, home, *steps)
    # Its first run slowed, so that it is still running when the signal comes.
    preempted = submit(tmp_path, home, *steps, CTXLAUNCH_INJECT_FAULT=FIRST_RUN_SLOW)
    wait_for_log(home, preempted, r"^0: step 5/")
    # A stop signal to the job's tasks only (what the start of a preemption's grace sends).
    signal = run(["scancel", "--signal=USR1", preempted], home, tmp_path)
    assert signal.returncode == 0, signal.stderr
    for job_id in (straight, preempted):
        waited = ctx(
            home, tmp_path, "wait", job_id, "--timeout", "300", "--poll", "0.5", timeout=320
        )
        assert waited.returncode == 0, waited.stdout + waited.stderr
    final = status(home, tmp_path, preempted)
    assert final["state"] == "COMPLETED" and final["restarts"] == 1
    log = ctx(home, tmp_path, "logs", preempted).stdout
    stopped_at = int(re.search(r"checkpointed at step (\d+)", log).group(1))
    assert 5 <= stopped_at < 30
    assert f"requeueing job {preempted} (restart 1 of 3)" in log
    assert f"resumed from {tmp_path / 'ckpt'}/step-{stopped_at:08d}" in log
    assert "0: ctxlaunch: done: 30 steps" in log
    # Nothing lost: the same final loss as the run that was never interrupted.
    assert final_loss(home, preempted) == final_loss(home, straight)


@pytest.mark.timeout(60)
def test_bad_input_gives_a_clear_error_and_no_job(tmp_path: Path, home: Path) -> None:
    args = [CTXLAUNCH, "submit", str(JOBS / "demo.yaml")]
    for item in [*QUICK, "cluster.slurm.partition=nosuchpartition"]:
        args += ["--set", item]
    result = run(args, home, tmp_path)
    assert result.returncode == 2
    assert "sbatch refused the job" in result.stderr and "partition" in result.stderr.lower()
    assert not (home / "jobs").exists() or not any((home / "jobs").iterdir())

    args = [CTXLAUNCH, "submit", str(JOBS / "demo.yaml")]
    for item in [*QUICK, "model.preset=small", "training.seq_len=2097152"]:
        args += ["--set", item]
    result = run(args, home, tmp_path)
    assert result.returncode == 2 and "predicted not to fit" in result.stderr

    for command in ("status", "logs", "cancel", "wait"):
        result = ctx(home, tmp_path, command, "999999")
        assert result.returncode == 2 and "no job '999999'" in result.stderr, command


@pytest.mark.timeout(300)
def test_a_sweep_submits_as_one_job_array(tmp_path: Path, home: Path) -> None:
    import yaml

    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "sweep": {
                    "name": "arr",
                    "base": str(JOBS / "demo.yaml"),
                    "set": {
                        "training.steps": 2,
                        "training.checkpoint.dir": None,
                        **{
                            k: v
                            for k, v in (s.split("=", 1) for s in QUICK)
                            if k != "training.seq_len"
                        },
                    },
                    "axes": {"training.seq_len": [512, 1024]},
                }
            },
            sort_keys=False,
        )
    )
    result = run([CTXLAUNCH, "sweep", str(sweep_file)], home, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    array_id = re.search(r"submitted job array (\d+) \(2 tasks", result.stderr).group(1)
    sweep_id = result.stdout.strip().splitlines()[-1]
    for task in (f"{array_id}_0", f"{array_id}_1"):
        waited = ctx(home, tmp_path, "wait", task, "--timeout", "200", "--poll", "0.5", timeout=220)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    report = json.loads(ctx(home, tmp_path, "report", sweep_id, "--json").stdout)
    assert [(r["training.seq_len"], r["state"]) for r in report["rows"]] == [
        (512, "COMPLETED"),
        (1024, "COMPLETED"),
    ]
    assert all(r["tokens_per_second_per_gpu"] > 0 for r in report["rows"])
    assert "0: ctxlaunch: done: 2 steps" in ctx(home, tmp_path, "logs", f"{array_id}_1").stdout
