"""A job that heals itself (training.heal on_oom replan) on the real Kubernetes node
(scripts/services/kubernetes-node.sh): the container's memory limit is too small for the
spec's layout, the memory cgroup kills the rank (containerd reports OOMKilled), the pod entry
records the OOM in the heal log and exits retryable, the PyTorchJob operator stand-in
(devkit/pytorchjob_operator.py: no training operator can be installed here) replaces the
pod, and the new pod re-plans to a layout that fits and completes.

The healed run's losses equal those of a fresh run at the new layout (the OOM strikes before the
first checkpoint, so the fresh run starts at step 0); the test prints the steps lost and the time
from the kill to the first step after it (a HEAL-FIGURES line, for RELIABILITY.md)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxlaunch.contract import exitcodes
from devkit.kube_node import (
    NODE_ADMIN,
    ctx,
    kubectl,
    new_namespace,
    submit_args,
    with_checkpoint_volume,
)
from devkit.pytorchjob_operator import PyTorchJobOperator
from tests.helpers.healing import (
    assert_same_losses,
    first_step_after,
    last_step_before,
    losses_by_step,
    replanned_figures_line,
    replans,
)

MEMORY_BOUND = (
    "model.layers=16",
    "training.seq_len=2048",
    "training.steps=6",
    "training.log_interval=1",
    "training.checkpoint.interval=6",
    "training.checkpoint.dir=/checkpoints",
    "training.activation_checkpointing=none",
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "parallel.cp=1",
    "cluster.kubernetes.shm_size=256Mi",
)
"""The demo model 16 blocks deep at 2,048 tokens on one rank (see MEMORY_LIMIT), checkpointed at
its end only: the kill strikes in step 1 to 3 (the page cache the cgroup reclaims first makes
the step vary), always before the checkpoint, so the healed run starts at step 0."""
MEMORY_LIMIT = "850Mi"
"""The container's memory limit: below what the pod needs without activation checkpointing
(the pod entry, torchrun's agent and the rank), above it with selective or full. The pod's
memory cgroup peaked at 1,006 MiB without and 736 MiB with selective under a 3,000 MiB limit
(memory.max_usage_in_bytes, page cache included, three steps); under this limit the planner
counts 685 MiB for the rank (the limit less what the processes beside it hold), and predicts
0.58 GiB with selective."""
RUN_DIR = "/checkpoints/run"
"""The run directory on the checkpoint volume, so the events and metrics of both pods stay."""


@pytest.fixture
def namespace(image: str) -> Iterator[str]:
    name = new_namespace("heal")
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


def run_job(
    home: Path, image: str, namespace: str, name: str, host_dir: Path, *sets: str
) -> tuple[str, PyTorchJobOperator]:
    """Submit the demo with `sets`, its checkpoints and run directory on `host_dir`, and start
    the operator stand-in once the volume is in the pod template."""
    result = ctx(
        home,
        "submit",
        *submit_args(image, namespace, name, *sets, f"cluster.kubernetes.run_dir={RUN_DIR}"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with_checkpoint_volume(namespace, name, host_dir)
    stand_in = PyTorchJobOperator(str(NODE_ADMIN), namespace, init_image=image).start()
    return result.stdout.strip(), stand_in


def completed(home: Path, job: str, stand_in: PyTorchJobOperator) -> dict:
    try:
        waited = ctx(home, "wait", job, "--timeout", "400", "--poll", "1", timeout=420)
    finally:
        stand_in.stop()
    assert not stand_in.errors, stand_in.errors
    assert waited.returncode == 0, waited.stdout + waited.stderr
    result = ctx(home, "status", job, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.mark.timeout(900)
def test_an_oomkilled_pod_is_replaced_and_the_job_replans_and_completes(
    image: str, namespace: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    host_dir = tmp_path / "healed"
    host_dir.mkdir()
    job, stand_in = run_job(
        home,
        image,
        namespace,
        "healed",
        host_dir,
        *MEMORY_BOUND,
        f"cluster.kubernetes.memory={MEMORY_LIMIT}",
        "training.heal.on_oom=replan",
    )
    run_dir = host_dir / "run"
    final = completed(home, job, stand_in)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, final
    (replanned,) = replans(run_dir)
    assert replanned.get("why") == "oom", replanned.fields
    assert replanned.get("step") == 0, replanned.fields
    after = replanned.get("to")["changes"]["training.activation_checkpointing"]
    assert after in ("selective", "full"), replanned.fields
    figures = replanned.get("figures")
    assert figures["predicted_peak_bytes"] * figures["margin"] <= figures["capacity_bytes"]
    (story,) = final["healing"]
    assert re.match(
        r"OOM \(killed at the memory limit\) at step [1-6] with checkpointing none; "
        r"resumed at step 0 with checkpointing (selective|full)",
        story,
    ), story
    # The pod the kernel's OOM killer ended (containerd: OOMKilled), replaced by the operator
    # on its retryable exit; the kubelet's record of when it ended is the fault's time.
    (killed,) = stand_in.replaced
    assert killed["reason"] == "OOMKilled", killed
    assert killed["exit_code"] == exitcodes.POD_RETRY, killed
    fault = killed["finished_at"].timestamp()
    first = first_step_after(run_dir, replanned.time_seconds)
    assert first is not None
    reached = last_step_before(run_dir, fault)
    print(
        replanned_figures_line(
            f"OOMKilled pod (memory limit {MEMORY_LIMIT})", replanned, first, fault, reached
        )
    )
    healed = losses_by_step(run_dir)
    # A fresh run at the new layout, from the start, with no limit and no healing.
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    fresh_job, fresh_stand_in = run_job(
        home,
        image,
        namespace,
        "fresh",
        fresh_dir,
        *MEMORY_BOUND,
        f"training.activation_checkpointing={after}",
    )
    assert completed(home, fresh_job, fresh_stand_in)["state"] == "COMPLETED"
    fresh = losses_by_step(fresh_dir / "run")
    assert_same_losses(healed, fresh, range(1, 7))
