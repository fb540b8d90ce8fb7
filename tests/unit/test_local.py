"""The local target end to end through the real command: torchrun, gloo, the trainer; and the
faults: a dead rank, an injected failure, an OOM, unusable checkpoint directories, layouts the
trainer cannot take. Every test has a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.healing import losses_by_step
from tests.helpers.paths import JOBS

pytestmark = pytest.mark.distributed
CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
SHORT = [
    "--set",
    "training.steps=3",
    "--set",
    "training.seq_len=512",
    "--set",
    "training.log_interval=1",
]


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home"), **extra}
    env.pop("CTXLAUNCH_INJECT_FAULT", None)
    env.update(extra)
    return env


def submit(tmp_path: Path, *args: str, timeout: float = 240, **extra: str):
    return subprocess.run(
        [
            CTXLAUNCH,
            "submit",
            str(JOBS / "demo.yaml"),
            *SHORT,
            "--set",
            f"training.checkpoint.dir={tmp_path / 'ckpt'}",
            *args,
        ],
        cwd=tmp_path,
        env=env_for(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def job_dirs(tmp_path: Path) -> list[Path]:
    root = tmp_path / "home" / "jobs"
    return sorted(root.iterdir()) if root.is_dir() else []


@pytest.mark.timeout(300)
def test_demo_runs_locally_and_summarises(tmp_path: Path) -> None:
    result = submit(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dp 1 x cp 2 (ring, zigzag)" in result.stdout
    assert "step 3/3" in result.stdout and "ctxlaunch: done: 3 steps" in result.stdout
    assert "peak memory per rank" in result.stdout
    (job,) = job_dirs(tmp_path)
    summary = json.loads((job / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["cp"] == 2 and summary["world_size"] == 2
    assert summary["tokens_per_second_per_gpu"] > 0
    assert len(summary["peak_memory_bytes_per_rank"]) == 2
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert json.loads((job / "job.json").read_text())["extra"]["exit_status"] == 0
    assert (tmp_path / "ckpt" / "step-00000003" / "COMMITTED").is_file()


@pytest.mark.timeout(60)
def test_dry_run_prints_the_exact_command_and_starts_nothing(tmp_path: Path) -> None:
    result = submit(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    command = next(line for line in result.stdout.splitlines() if "torch.distributed.run" in line)
    assert "--nproc-per-node=2" in command and "-m ctxlaunch.runtime.trainer" in command
    assert '"cp":2' in result.stdout  # the spec that would travel
    assert job_dirs(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_job_that_does_not_fit_is_refused_unless_forced(tmp_path: Path) -> None:
    big = ["--set", "model.preset=small", "--set", "training.seq_len=2097152"]
    result = submit(tmp_path, *big)
    assert result.returncode == 2
    assert "predicted not to fit" in result.stderr and "GiB over" in result.stderr
    assert "would fit with cp = 16" in result.stderr
    assert job_dirs(tmp_path) == []
    forced = submit(tmp_path, *big, "--force", "--dry-run")
    assert forced.returncode == 0, forced.stderr


@pytest.mark.timeout(300)
def test_injected_failure_reports_the_failing_rank(tmp_path: Path) -> None:
    result = submit(tmp_path, CTXLAUNCH_INJECT_FAULT="kind=error,rank=1,step=2")
    assert result.returncode == 1, result.stdout + result.stderr
    # Rank 1 raised; rank 0 was then killed by torchrun or failed on the broken group.
    assert "rank exit codes:" in result.stderr and ", 1" in result.stderr
    assert "injected by CTXLAUNCH_INJECT_FAULT" in result.stderr  # the failing rank's log tail


@pytest.mark.timeout(300)
def test_injected_oom_exits_with_the_oom_status(tmp_path: Path) -> None:
    result = submit(tmp_path, CTXLAUNCH_INJECT_FAULT="kind=oom,rank=0,step=2")
    assert result.returncode == 86, result.stdout + result.stderr
    assert "out of memory" in result.stderr


def trainer_rank(tmp_path: Path, rank: int, port: int, *extra: str) -> subprocess.Popen:
    env = env_for(
        tmp_path,
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "ctxlaunch.runtime.trainer",
            str(JOBS / "demo.yaml"),
            "--set",
            "training.steps=1000",
            "--set",
            "training.seq_len=512",
            "--set",
            "training.timeout_seconds=20",
            "--set",
            "training.checkpoint.dir=null",
            "--set",
            "training.log_interval=1",
            "--run-dir",
            str(tmp_path / "run"),
            *extra,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(180)
def test_a_dead_rank_ends_the_others_with_an_error_not_a_hang(tmp_path: Path) -> None:
    port = 29400 + os.getpid() % 500
    ranks = [trainer_rank(tmp_path, r, port) for r in range(2)]
    try:
        for line in ranks[0].stdout:  # wait until training is under way
            if line.startswith("step 2/"):
                break
        ranks[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = ranks[0].wait(timeout=60)
        waited = time.monotonic() - killed_at
        stderr = ranks[0].stderr.read()
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 1, stderr
    assert "training failed" in stderr
    assert waited < 20 + 30  # the collective timeout plus margin, in practice far less


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.checkpoint.dir=/proc/ctxlaunch-cannot-write"], "cannot be written"),
        (
            ["parallel.pp=2", "cluster.gpus_per_node=2", "model.tie_embeddings=true"],
            "tied embeddings put one weight on the first and the last pipeline stage",
        ),
        (["training.data.source=text"], "needs data.path"),
        (["training.data.source=text", "training.data.path=/nonexistent.txt"], "no such file"),
    ],
)
def test_bad_set_up_fails_before_any_work(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    env = env_for(tmp_path)
    sets = [
        arg
        for item in ["cluster.gpus_per_node=1", "parallel.cp=1", *overrides]
        for arg in ("--set", item)
    ]
    result = subprocess.run(
        [sys.executable, "-m", "ctxlaunch.runtime.trainer", str(JOBS / "demo.yaml"), *sets],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "step 1" not in result.stdout


@pytest.mark.timeout(60)
def test_world_size_must_match_the_spec(tmp_path: Path) -> None:
    env = env_for(tmp_path, RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    result = subprocess.run(
        [sys.executable, "-m", "ctxlaunch.runtime.trainer", str(JOBS / "demo.yaml")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "started 3 ranks but the spec describes 2" in result.stderr


@pytest.mark.timeout(60)
def test_a_gpu_spec_without_a_gpu_fails_before_any_work(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxlaunch.runtime.trainer",
            str(JOBS / "demo.yaml"),
            "--set",
            "cluster.gpu=H100",
            "--set",
            "cluster.gpus_per_node=1",
            "--set",
            "parallel.cp=1",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=tmp_path,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cluster.gpu = H100 but no CUDA device is visible" in result.stderr
    assert (tmp_path / "run" / "exit" / "rank-0").read_text().strip() == "2"


@pytest.mark.timeout(400)
def test_4d_demo_submits_and_trains_locally(tmp_path: Path) -> None:
    """jobs/demo-4d.yaml (TP 2 x CP 2 x PP 2, eight gloo ranks) through `ctxlaunch submit`,
    shortened; its exactness against one process is tests/unit/test_trainer_4d.py's."""
    result = subprocess.run(
        [
            CTXLAUNCH,
            "submit",
            str(JOBS / "demo-4d.yaml"),
            "--set",
            "training.steps=2",
            "--set",
            "training.seq_len=256",
            "--set",
            "training.log_interval=1",
            "--set",
            f"training.checkpoint.dir={tmp_path / 'ckpt'}",
        ],
        cwd=tmp_path,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dp 1 x cp 2 (ring, zigzag) x tp 2 x pp 2 (blocks per stage [1, 1])" in result.stdout
    assert "step 2/2" in result.stdout and "ctxlaunch: done: 2 steps" in result.stdout
    (job,) = job_dirs(tmp_path)
    summary = json.loads((job / "summary.json").read_text())
    assert summary["world_size"] == 8 and summary["steps"] == 2
    assert (tmp_path / "ckpt" / "step-00000002" / "COMMITTED").is_file()


@pytest.mark.timeout(420)
def test_a_healing_job_replans_after_an_oom_and_resumes_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """The OOM is injected (CTXLAUNCH_INJECT_FAULT kind=oom, once): the trainer records it as
    the allocator's would be, and the local launcher runs the job again at a new layout."""
    result = submit(
        tmp_path,
        "--set",
        "training.steps=6",
        "--set",
        "training.checkpoint.interval=2",
        "--set",
        "training.checkpoint.keep=10",
        "--set",
        "training.heal.on_oom=replan",
        CTXLAUNCH_INJECT_FAULT=f"kind=oom,rank=0,step=3,once={tmp_path / 'fired'}",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "training.heal re-plans the layout" in output
    (job,) = job_dirs(tmp_path)
    replanned = [
        json.loads(line)
        for line in (job / "events.jsonl").read_text().splitlines()
        if '"replanned"' in line
    ]
    assert len(replanned) == 1, replanned
    assert replanned[0]["why"] == "oom" and replanned[0]["step"] == 2, replanned
    assert replanned[0]["from"]["layout"] != replanned[0]["to"]["layout"], replanned
    shown = subprocess.run(
        [CTXLAUNCH, "status", job.name],
        cwd=tmp_path,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "healed: OOM" in shown.stdout and "resumed at step 2" in shown.stdout, shown.stdout
    # The healed steps are those of a fresh run at the new layout from the same checkpoint.
    fresh_ckpt = tmp_path / "fresh-ckpt"
    shutil.copytree(tmp_path / "ckpt" / "step-00000002", fresh_ckpt / "step-00000002")
    sets = [f"{key}={json.dumps(value)}" for key, value in replanned[0]["to"]["changes"].items()]
    fresh = subprocess.run(
        [
            CTXLAUNCH,
            "submit",
            str(JOBS / "demo.yaml"),
            *SHORT,
            "--set",
            "training.steps=6",
            *[arg for item in sets for arg in ("--set", item)],
            "--set",
            f"training.checkpoint.dir={fresh_ckpt}",
        ],
        cwd=tmp_path,
        env=env_for(tmp_path, CTXLAUNCH_HOME=str(tmp_path / "fresh-home")),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    (fresh_job,) = sorted((tmp_path / "fresh-home" / "jobs").iterdir())
    healed, reference = losses_by_step(job), losses_by_step(fresh_job)
    torch.testing.assert_close(
        torch.tensor([healed[s] for s in range(3, 7)], dtype=torch.float64),
        torch.tensor([reference[s] for s in range(3, 7)], dtype=torch.float64),
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_lone_process_rendezvous_on_a_free_port() -> None:
    """A single-process job does not take torch's default port 29500 (another job, or another
    program, may hold it): it picks a free one, unless MASTER_PORT names one."""
    import errno
    import socket

    from ctxlaunch.runtime.parallel.distenv import detect

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as default:
        try:
            default.bind(("127.0.0.1", 29500))
            default.listen()
        except OSError as exc:  # already held elsewhere: just as good
            assert exc.errno == errno.EADDRINUSE
        lone = detect({})
        assert lone.launcher == "single" and lone.master_port != 29500
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", lone.master_port))  # free
    assert detect({"MASTER_PORT": "23456"}).master_port == 23456


def _processes_naming(text: str) -> list[int]:
    """The pids of the processes whose command line holds `text` (a job's directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in command and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(300)
def test_a_killed_submit_leaves_no_rank_and_its_job_reads_lost(tmp_path: Path) -> None:
    """A local job holds its checkpoint directory: a second job on it is refused naming the
    first. SIGKILL to the first `submit`'s process group (a closed terminal) leaves no rank
    running within seconds (the ranks sit in sessions of their own), the directory is free
    again, and the job reads LOST with its last step and checkpoint: `wait` without a timeout
    returns."""
    from ctxlaunch.contract import dirlock

    first = subprocess.Popen(
        [
            CTXLAUNCH,
            "submit",
            str(JOBS / "demo.yaml"),
            *SHORT,
            "--set",
            "training.steps=200",
            "--set",
            "training.checkpoint.interval=1",
            "--set",
            f"training.checkpoint.dir={tmp_path / 'ckpt'}",
        ],
        cwd=tmp_path,
        env=env_for(tmp_path, CTXLAUNCH_INJECT_FAULT="kind=slow,seconds=0.5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert first.stdout is not None
        for line in first.stdout:  # a checkpoint committed: the ranks hold the directory
            if line.startswith("ctxlaunch: checkpoint"):
                break
        (job,) = job_dirs(tmp_path)
        second = submit(tmp_path, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"is in use by job {job.name} (host " in " ".join(second.stderr.split())
        assert len(_processes_naming(str(job))) >= 3  # torchrun and its two ranks
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        # An exiting process's command line reads empty before its files close: the
        # directory is free once the last rank has fully gone.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (
            _processes_naming(str(job)) or dirlock.holder(tmp_path / "ckpt") is not None
        ):
            time.sleep(0.2)
        assert _processes_naming(str(job)) == []
        assert dirlock.holder(tmp_path / "ckpt") is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        for pid in _processes_naming(str(tmp_path)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    waited = subprocess.run(
        [CTXLAUNCH, "wait", job.name, "--poll", "0.2"],
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert waited.returncode == 1, waited.stdout + waited.stderr
    said = " ".join(waited.stdout.split())
    assert f"{job.name}: LOST" in said and "its last logged step was" in said, said
    assert "the newest checkpoint is step" in said, said
