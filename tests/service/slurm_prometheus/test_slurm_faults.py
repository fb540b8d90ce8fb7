"""Faults on the real multi-node Slurm cluster (scripts/services/slurm.sh: node1 and node2, each
a slurmd in its own network namespace, partitions "low" and "high"): preemption, a time limit,
a dead node, stop signals on every path, a hung rank, and checkpoints interrupted mid-write.

The faulted jobs run `nodes: 2` (one rank per node, the rendezvous on node1), and must end with
the final loss of the same job run without a fault. Tiny steps and short timeouts keep each test
within a minute or two; every test has a timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.inprocess import log_now, status_now
from tests.helpers.paths import ROOT
from tests.helpers.slurm_jobs import (
    FIRST_RUN_SLOW,
    ctx,
    final_loss,
    job_dir,
    node_pids,
    run,
    status,
    submit,
    wait_for,
    wait_for_log,
)

STEPS = 40
# Two ranks on two nodes, short steps, a checkpoint every 4 steps, a short collective timeout.
TWO_NODES = [
    "training.seq_len=512",
    f"training.steps={STEPS}",
    "training.checkpoint.interval=4",
    "cluster.nodes=2",
    "cluster.gpus_per_node=1",
    "cluster.slurm.partition=low",
    "training.timeout_seconds=30",
]


pytestmark = [pytest.mark.usefixtures("slurm"), pytest.mark.service_group("slurm_nodes")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The final loss of an uninterrupted run of the same 2-node job (one rank per node: the
    threads per rank, and so the float rounding, follow the ranks per node)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    home = tmp_path / "home"
    job_id = two_node_job(tmp_path, home)
    waited = ctx(home, tmp_path, "wait", job_id, "--timeout", "200", "--poll", "0.5", timeout=220)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    return final_loss(home, job_id)


def two_node_job(tmp_path: Path, home: Path, *sets: str, **extra: str) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return submit(tmp_path, home, *TWO_NODES, *sets, **extra)


def complete(home: Path, tmp_path: Path, job_id: str, timeout: float = 240) -> dict:
    waited = ctx(
        home,
        tmp_path,
        "wait",
        job_id,
        "--timeout",
        str(timeout),
        "--poll",
        "0.5",
        timeout=timeout + 20,
    )
    assert waited.returncode == 0, waited.stdout + waited.stderr
    return status(home, tmp_path, job_id)


def resumed_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S*step-(\d+)", log)]


def last_logged_step(log: str) -> int:
    return max(int(s) for s in re.findall(r"^0: step (\d+)/", log, re.M))


@pytest.mark.timeout(420)
def test_two_node_job_preempted_by_a_high_partition_job_resumes_and_matches(
    tmp_path: Path, home: Path, reference: float
) -> None:
    job_id = two_node_job(tmp_path, home, CTXLAUNCH_INJECT_FAULT=FIRST_RUN_SLOW)
    wait_for_log(home, job_id, r"^0: step 6/")
    # A job on the higher-tier partition wants both nodes: Slurm preempts ours (grace 10 s).
    high = run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "high",
            "-N",
            "2",
            "--exclusive",
            "-o",
            str(tmp_path / "high-%j.out"),
            "--wrap",
            "sleep 2",
        ],
        home,
        tmp_path,
    )
    assert high.returncode == 0, high.stderr
    final = complete(home, tmp_path, job_id)
    log = ctx(home, tmp_path, "logs", job_id).stdout
    # The multi-node path ran: one rank per node, the rendezvous on the first node.
    assert re.search(rf"job {job_id} restart 0 on 2 node\(s\), rendezvous node1:\d+", log)
    nodes = run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "NodeList"], home, tmp_path)
    assert "node[1-2]" in nodes.stdout
    stopped = int(re.search(r"checkpointed at step (\d+)", log).group(1))
    assert f"stopped by preemption (exit 75); requeueing job {job_id} (restart 1 of 3)" in log
    assert resumed_steps(log)[0] == stopped
    # `logs` shows each run's lines in order: the first run, its requeue, the second run.
    order = [
        f"job {job_id} restart 0 on",
        "stopped by preemption",
        f"job {job_id} restart 1 on",
        "resumed from",
        "0: ctxlaunch: done: 40 steps",
    ]
    positions = [log.index(text) for text in order]
    assert positions == sorted(positions), positions
    assert final["state"] == "COMPLETED" and final["restarts"] == 1
    assert final["history"][0].startswith("run 1: PREEMPTED, checkpoint at step")
    assert final_loss(home, job_id) == reference
    high_state = run(
        ["sacct", "-j", high.stdout.strip(), "-X", "-n", "-P", "-o", "State"], home, tmp_path
    )
    assert high_state.stdout.strip() == "COMPLETED"


@pytest.mark.timeout(480)
def test_a_time_limit_checkpoints_requeues_and_completes_later(tmp_path: Path, home: Path) -> None:
    # Two minutes per allocation, SIGUSR1 to the batch shell 20 s before the limit, plus up to
    # the 30 s of Slurm's limit checks: 70 to 100 s of each run. (With one minute, a loaded
    # machine spent most of each short window starting the ranks, and eight requeues did not
    # reach the end.) In the first run every step sleeps 4 s on top of its work (the `slow`
    # fault, bound to restart 0), so its 30 steps take at least 120 s: more than one allocation
    # holds however fast the machine runs them. The requeued runs go at the machine's pace.
    job_id = two_node_job(
        tmp_path,
        home,
        "training.steps=30",
        "training.checkpoint.interval=50",
        "cluster.slurm.time_limit=00:02:00",
        "cluster.slurm.signal_seconds=20",
        "cluster.slurm.max_restarts=8",
        CTXLAUNCH_INJECT_FAULT="kind=slow,seconds=4,restart=0",
    )
    wait_for(home, job_id, {"PENDING", "RUNNING"}, timeout=30)
    deadline = time.monotonic() + 200
    while "stopped by the time limit" not in (log := log_now(home, job_id)):
        assert time.monotonic() < deadline, log
        assert status_now(home, job_id)["state"] in ("PENDING", "RUNNING"), log
        time.sleep(1)
    requeued = wait_for(home, job_id, {"PENDING", "RUNNING"}, timeout=30)
    final = complete(home, tmp_path, job_id, timeout=360)
    log = ctx(home, tmp_path, "logs", job_id).stdout
    assert "SIGUSR1 to the batch script; asking the ranks to checkpoint and stop" in log
    stopped = int(re.search(r"checkpointed at step (\d+)", log).group(1))
    assert resumed_steps(log)[0] == stopped
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, final
    assert final["history"][0].startswith("run 1: TIMEOUT, checkpoint at step")
    assert requeued["restarts"] >= 1
    assert "0: ctxlaunch: done: 30 steps" in log


@pytest.mark.timeout(420)
def test_a_dead_node_requeues_the_job_which_resumes_and_matches(
    tmp_path: Path, home: Path, reference: float
) -> None:
    job_id = two_node_job(tmp_path, home, CTXLAUNCH_INJECT_FAULT=FIRST_RUN_SLOW)
    wait_for_log(home, job_id, r"^0: step 7/")
    # node2 dies at once: its slurmd, its step daemon and its rank.
    for pid in node_pids("node2"):
        os.kill(pid, signal.SIGKILL)
    log = ctx(home, tmp_path, "logs", job_id).stdout
    reached = last_logged_step(log)
    try:
        # Slurm notices after SlurmdTimeout (10 s), sets the node DOWN and requeues the job.
        requeued = wait_for(home, job_id, {"PENDING"}, timeout=90)
        assert requeued["restarts"] == 1
        assert requeued["story"].startswith("NODE_FAIL and requeued (restart 1 of 3)"), requeued
    finally:
        # The node comes back (a fresh slurmd; ReturnToService=2 returns it at once).
        started = subprocess.run(
            [str(ROOT / "scripts/services/slurm.sh"), "start"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert started.returncode == 0, started.stderr
    final = complete(home, tmp_path, job_id)
    log = ctx(home, tmp_path, "logs", job_id).stdout
    resumed = resumed_steps(log)[0]
    # At most one checkpoint interval lost.
    assert reached - 4 <= resumed <= reached and resumed % 4 == 0
    assert final["state"] == "COMPLETED" and final["history"][0].startswith("run 1: NODE_FAIL")
    assert final_loss(home, job_id) == reference


# scancel form -> the cause the batch script names; see real-services.md for who gets what.
SIGNAL_PATHS = {
    "batch-shell": (["--batch", "--signal=USR1"], "SIGUSR1 to the batch script"),
    "tasks": (["--signal=TERM"], "a stop signal to the ranks"),
    "both": (["--batch", "--full", "--signal=USR1"], "SIGUSR1 to the batch script"),
    # srun answers TERM by SIGKILLing its tasks: the periodic checkpoint is what is left.
    "full-term": (["--full", "--signal=TERM"], "SIGTERM to the batch script"),
}


@pytest.mark.timeout(480)
def test_stop_signals_on_every_path_end_in_checkpoint_requeue_resume(
    tmp_path: Path, home: Path, reference: float
) -> None:
    jobs = {
        name: two_node_job(
            tmp_path / name,
            home,
            f"training.checkpoint.dir={tmp_path / name / 'ckpt'}",
            CTXLAUNCH_INJECT_FAULT=FIRST_RUN_SLOW,
        )
        for name in SIGNAL_PATHS
    }
    reached = {}
    for name, job_id in jobs.items():
        wait_for_log(home, job_id, r"^0: step 6/", timeout=150)
        sent = run(["scancel", *SIGNAL_PATHS[name][0], job_id], home, tmp_path)
        assert sent.returncode == 0, sent.stderr
        reached[name] = last_logged_step(ctx(home, tmp_path, "logs", job_id).stdout)
    for name, job_id in jobs.items():
        final = complete(home, tmp_path, job_id, timeout=300)
        log = ctx(home, tmp_path, "logs", job_id).stdout
        cause = SIGNAL_PATHS[name][1]
        assert f"stopped by {cause} (exit " in log and "(restart 1 of 3)" in log, (name, log)
        resumed = resumed_steps(log)[0]
        if name == "full-term":
            assert reached[name] - 4 <= resumed <= reached[name] + 1, (name, log)
        else:  # the ranks checkpointed on the signal
            stopped = int(re.search(r"checkpointed at step (\d+)", log).group(1))
            assert resumed == stopped >= reached[name], (name, log)
        assert final["state"] == "COMPLETED" and final["restarts"] == 1, (name, final)
        assert "JobLaunchFailure" not in json.dumps(final)
        assert final_loss(home, job_id) == reference, name


@pytest.mark.timeout(300)
def test_a_user_cancel_stays_cancelled(tmp_path: Path, home: Path) -> None:
    job_id = two_node_job(tmp_path, home, "training.steps=100000")
    wait_for_log(home, job_id, r"^0: step 5/")
    assert ctx(home, tmp_path, "cancel", job_id).returncode == 0
    final = wait_for(home, job_id, {"CANCELLED", "COMPLETED", "FAILED"}, timeout=30)
    time.sleep(3)  # a wrongly requeued job would be PENDING by now
    final = status(home, tmp_path, job_id)
    assert final["state"] == "CANCELLED" and final["restarts"] == 0, final
    assert final["story"].startswith("CANCELLED by the user"), final


def rank_pid(job_id: str, node: str) -> int:
    """The trainer process of job `job_id` on `node`."""
    for pid in node_pids(node):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("python") and f"SLURM_JOB_ID={job_id}".encode() in environ:
            return pid
    raise AssertionError(f"no rank of job {job_id} on {node}")


@pytest.mark.timeout(300)
def test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named(
    tmp_path: Path, home: Path
) -> None:
    job_id = two_node_job(tmp_path, home, "training.steps=100000", "training.timeout_seconds=20")
    wait_for_log(home, job_id, r"^0: step 4/")
    os.kill(rank_pid(job_id, "node2"), signal.SIGSTOP)  # alive, silent: rank 1
    waited = ctx(home, tmp_path, "wait", job_id, "--timeout", "150", "--poll", "0.5", timeout=170)
    log = ctx(home, tmp_path, "logs", job_id).stdout
    assert waited.returncode == 1, waited.stdout + waited.stderr + log
    assert f"{job_id}: FAILED" in waited.stdout, waited.stdout + log
    assert re.search(
        r"rank 1 \(silent \d+ s\) hung: stopped or stuck, not dead; rank 0 gave "
        r"up waiting for it after the collective timeout",
        waited.stdout,
    ), waited.stdout


@pytest.mark.timeout(300)
def test_a_checkpoint_killed_mid_write_is_never_resumed_from(
    tmp_path: Path, home: Path, reference: float
) -> None:
    ckpt = tmp_path / "ckpt"
    job_id = two_node_job(tmp_path, home, CTXLAUNCH_INJECT_FAULT="kind=kill_in_save,rank=0,step=8")
    waited = ctx(home, tmp_path, "wait", job_id, "--timeout", "150", "--poll", "0.5", timeout=170)
    assert waited.returncode == 1 and f"{job_id}: FAILED" in waited.stdout, waited.stdout
    # Step 8's files were written, its commit marker never: step 4 stays the resume point.
    assert (ckpt / "step-00000008").is_dir() and not (ckpt / "step-00000008" / "COMMITTED").exists()
    assert (ckpt / "step-00000004" / "COMMITTED").is_file()
    rerun = two_node_job(tmp_path, home)
    complete(home, tmp_path, rerun)
    assert resumed_steps(ctx(home, tmp_path, "logs", rerun).stdout) == [4]
    assert final_loss(home, rerun) == reference


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 64 MiB tmpfs of our own, unmounted after the test."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "ctxlaunch-test", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.timeout(300)
def test_a_full_disk_is_reported_and_the_previous_checkpoint_stays(
    tmp_path: Path, home: Path, small_disk: Path
) -> None:
    ckpt = small_disk / "ckpt"
    job_id = two_node_job(
        tmp_path,
        home,
        f"training.checkpoint.dir={ckpt}",
        "training.checkpoint.interval=10",
        "training.steps=100000",
    )
    marker = ckpt / "step-00000010" / "COMMITTED"
    deadline = time.monotonic() + 150
    while not marker.exists():
        assert time.monotonic() < deadline, ctx(home, tmp_path, "logs", job_id).stdout
        time.sleep(0.1)
    # Fill the disk but for 1 MiB: the checkpoint of step 20 cannot be written.
    stats = os.statvfs(small_disk)
    filler = small_disk / "filler"
    with open(filler, "wb") as handle:
        handle.write(b"\0" * (stats.f_bavail * stats.f_frsize - 2**20))
    waited = ctx(home, tmp_path, "wait", job_id, "--timeout", "150", "--poll", "0.5", timeout=170)
    assert waited.returncode == 1 and f"{job_id}: FAILED" in waited.stdout, waited.stdout
    assert re.search(
        r"checkpoint \S+step-00000020 not written: the disk is full \(no space "
        r"left on device;",
        waited.stdout,
    ), waited.stdout
    assert "the newest complete checkpoint, step 10, is intact" in waited.stdout
    assert (ckpt / "step-00000010" / "COMMITTED").is_file()
    assert not (ckpt / "step-00000020" / "COMMITTED").exists()
    filler.unlink()
    rerun = two_node_job(
        tmp_path,
        home,
        f"training.checkpoint.dir={ckpt}",
        "training.checkpoint.interval=10",
        "training.steps=12",
    )
    complete(home, tmp_path, rerun)
    assert resumed_steps(ctx(home, tmp_path, "logs", rerun).stdout) == [10]
    assert job_dir(home, rerun).is_dir()
