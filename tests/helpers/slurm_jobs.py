"""The ctxlaunch CLI against the real Slurm cluster, as the Slurm tests drive it: submit the
demo with a quick layout, poll status and logs, find a job's record and its final loss.
The polls read through `ctxlaunch.api` in the test's process (tests/helpers/inprocess.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.inprocess import log_now, status_now
from tests.helpers.paths import JOBS

BIN = Path(sys.executable).parent
CTXLAUNCH = str(BIN / "ctxlaunch")
# Small and quick: 1,024-token sequences, two CPU ranks, a node shared with other tests' jobs.
QUICK = [
    "training.seq_len=1024",
    "training.log_interval=1",
    "cluster.target=slurm",
    "cluster.slurm.exclusive=false",
    "cluster.slurm.time_limit=10:00",
]


def run(args: list[str], home: Path, cwd: Path, timeout: float = 120, **extra: str):
    env = {**os.environ, "CTXLAUNCH_HOME": str(home), **extra}
    if "CTXLAUNCH_INJECT_FAULT" not in extra:
        env.pop("CTXLAUNCH_INJECT_FAULT", None)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


FIRST_RUN_SLOW = "kind=slow,seconds=0.5,restart=0"
"""Each step of a job's first run 0.5 s longer (the `slow` fault): the demo job's steps take
0.07 s each on an unloaded machine, less than the polling between seeing a step and sending
a fault, so a test that strikes a fixed-length job after a given step slows its first run to
be sure to hit it. The steps' losses do not change."""


def submit(tmp_path: Path, home: Path, *sets: str, **extra: str) -> str:
    """Submit the demo spec to Slurm; returns the Slurm job id."""
    args = [CTXLAUNCH, "submit", str(JOBS / "demo.yaml")]
    for item in [*QUICK, f"training.checkpoint.dir={tmp_path / 'ckpt'}", *sets]:
        args += ["--set", item]
    result = run(args, home, tmp_path, **extra)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.strip().splitlines()[-1]
    assert job_id.isdigit(), result.stdout
    assert f"submitted Slurm job {job_id}" in result.stderr
    return job_id


def ctx(home: Path, tmp_path: Path, *args: str, timeout: float = 120):
    return run([CTXLAUNCH, *args], home, tmp_path, timeout=timeout)


def status(home: Path, tmp_path: Path, job_id: str) -> dict:
    result = ctx(home, tmp_path, "status", job_id, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def wait_for(home: Path, job_id: str, states: set[str], timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        current = status_now(home, job_id)
        if current["state"] in states:
            return current
        assert time.monotonic() < deadline, f"job {job_id} still {current} after {timeout} s"
        time.sleep(0.5)


def wait_for_log(home: Path, job_id: str, pattern: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = log_now(home, job_id)
        if re.search(pattern, text, re.M):
            return text
        assert time.monotonic() < deadline, f"{pattern!r} not in the log of {job_id}:\n{text}"
        time.sleep(0.5)


def job_dir(home: Path, job_id: str) -> Path:
    (record,) = [
        p
        for p in (home / "jobs").iterdir()
        if json.loads((p / "job.json").read_text())["backend_id"] == job_id
    ]
    return record


def final_loss(home: Path, job_id: str) -> float:
    return json.loads((job_dir(home, job_id) / "run" / "summary.json").read_text())["final_loss"]


def node_pids(node: str) -> list[int]:
    """Every process in the test cluster node's network namespace (scripts/services/slurm.sh's
    ctxl-<node>): its slurmd, slurmstepd and tasks."""
    namespace = os.stat(f"/run/netns/ctxl-{node}").st_ino
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.stat(entry / "ns" / "net").st_ino == namespace:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def wait_for_agent_queue(home: Path, cwd: Path, timeout: float = 180) -> float:
    """Wait until slurmctld's retry list of messages to slurmd (sdiag's "Agent queue size") is
    empty; returns the seconds waited. A message to a node that stopped answering (a signal to
    a step on a dead node) waits there until the node answers again, and is then delivered to
    whatever step of that job holds the same step ID on the node: before a requeued job may
    run there again, the list must be empty."""
    start = time.monotonic()
    while True:
        shown = run(["sdiag"], home, cwd).stdout
        queued = re.search(r"^\s*Agent queue size:\s*(\d+)", shown, re.M)
        assert queued, f"no agent queue size in sdiag's report:\n{shown}"
        if queued.group(1) == "0":
            return time.monotonic() - start
        waited = time.monotonic() - start
        pending = run(["sdiag", "--all"], home, cwd).stdout.partition("Pending RPC")[2]
        assert waited < timeout, f"slurmctld still holds {queued.group(1)} message(s):{pending}"
        time.sleep(1)
