"""The PyTorchJob pod's command (`python3 -m ctxlaunch.runtime.podentry SPEC`) run here as the training
operator would start it on one node (the PET_* variables it sets), with real torchrun and two
gloo ranks: a SIGTERM (pod eviction, node drain) checkpoints and exits with a status the
operator's restartPolicy ExitCode retries (143), and the restarted pod resumes; a bad spec and
an OOM exit with statuses it does not retry (2, 86). Every test has a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctxlaunch.contract import exitcodes
from tests.helpers.paths import JOBS, free_port

pytestmark = pytest.mark.distributed


def spec_file(tmp_path: Path, *sets: str) -> Path:
    """The demo spec, resolved and small, as the ConfigMap would carry it."""
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.contract.rundir import spec_json

    spec = load_spec(
        JOBS / "demo.yaml",
        [
            "training.seq_len=512",
            "training.log_interval=1",
            f"training.checkpoint.dir={tmp_path / 'ckpt'}",
            "training.timeout_seconds=30",
            *sets,
        ],
    )
    path = tmp_path / "spec.json"
    path.write_text(spec_json(spec))
    return path


def pod(tmp_path: Path, spec: Path, **extra: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(free_port()),
        "CTXLAUNCH_RUN_DIR": str(tmp_path / "run"),
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    if "CTXLAUNCH_INJECT_FAULT" not in extra:
        env.pop("CTXLAUNCH_INJECT_FAULT", None)
    return subprocess.Popen(
        [sys.executable, "-m", "ctxlaunch.runtime.podentry", str(spec)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        raise AssertionError(f"the pod command did not end within {timeout} s:\n{out}") from None
    return process.returncode, out


@pytest.mark.timeout(300)
def test_sigterm_checkpoints_exits_retryable_and_the_next_pod_resumes(tmp_path: Path) -> None:
    spec = spec_file(tmp_path, "training.steps=400", "training.checkpoint.interval=1000")
    process = pod(tmp_path, spec)
    lines = []
    deadline = time.monotonic() + 150
    assert process.stdout is not None
    for line in process.stdout:  # rank 0 logs every step, prefixed by torchrun --tee
        lines.append(line)
        if line.startswith("[rank0]:step 2/"):
            break
        assert time.monotonic() < deadline, "no step 2 within 150 s:\n" + "".join(lines)
    process.send_signal(signal.SIGTERM)  # what the kubelet sends the container on eviction
    code, out = finish(process)
    out = "".join(lines) + out
    assert code == exitcodes.POD_RETRY == 143, out
    assert "exiting 75 to be requeued" in out and "pod exits 143" in out
    assert any((tmp_path / "ckpt").glob("step-*")), out

    again = pod(
        tmp_path, spec_file(tmp_path, "training.steps=8", "training.checkpoint.interval=1000")
    )
    code, out = finish(again)
    # The checkpointed step may already be the last one: resumed either way, then done.
    assert code == exitcodes.OK, out
    assert f"resumed from {tmp_path / 'ckpt'}/step-" in out


@pytest.mark.timeout(200)
def test_a_bad_spec_and_an_oom_end_the_pod_with_a_permanent_status(tmp_path: Path) -> None:
    code, out = finish(
        pod(
            tmp_path,
            spec_file(tmp_path, "training.steps=3", "parallel.cp=2", "cluster.nodes=1"),
            PET_NPROC_PER_NODE="1",
        )
    )
    assert code == exitcodes.BAD_INPUT, out  # the spec wants 2 ranks, the pod starts 1
    assert "launch 2" in out
    code, out = finish(
        pod(
            tmp_path,
            spec_file(tmp_path, "training.steps=3"),
            CTXLAUNCH_INJECT_FAULT="kind=oom,rank=1,step=2",
        )
    )
    assert code == exitcodes.OOM, out
    assert "pod exits 86" in out
    # The training operator's rule: 1-127 permanent, 128-255 retried.
    assert exitcodes.pod_exit_status(exitcodes.OOM) < 128
    assert exitcodes.pod_exit_status(exitcodes.BAD_INPUT) < 128
    assert exitcodes.pod_exit_status(exitcodes.PREEMPTED) >= 128


def test_oom_kills_reads_the_memory_cgroup_v1_and_v2_counters(tmp_path: Path) -> None:
    """The counters as the kernel writes them (memory.oom_control under v1's memory
    controller, memory.events at v2's root): what the pod command compares before and after
    its ranks ran. On the node, tests/service/kubernetes_node/test_kubernetes_node.py sees the real ones."""
    from ctxlaunch.runtime.podentry import oom_kills

    assert oom_kills(tmp_path) == 0
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert oom_kills(tmp_path) == 1
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n"
    )
    assert oom_kills(tmp_path) == 4
