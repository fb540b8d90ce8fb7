"""Jobs that heal themselves (training.heal) on the real Slurm cluster (scripts/services/slurm.sh:
node1 and node2 in network namespaces, partitions low and high; the host's node in debug;
every step in a memory cgroup, so --mem is a limit the kernel's OOM killer enforces).

- A 2-node job asked for with a node range (--nodes=1-2) whose node2 is killed and drained is
  requeued by Slurm, starts on node1 alone, where every rank agrees on the planner's layout for
  one node, and resumes from its checkpoint; when node2 is back and the job is requeued again,
  it grows back to its own layout on two nodes, and completes.
- A job whose --mem is too small for its layout has its rank killed by the OOM killer (Slurm:
  OUT_OF_MEMORY); the batch script records it and requeues the job, which re-plans to a layout
  that fits the limit, completes, and shows the re-plan in Prometheus.

Each healed stretch's losses equal those of a fresh run at the new layout from the same
checkpoint (within the cross-layout resume tests' tolerance); the tests print the steps lost
and the time from the fault to the first step after it (HEAL-FIGURES lines, for
RELIABILITY.md). Every test has a timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.healing import (
    assert_same_losses,
    figures_line,
    first_step_after,
    last_step_before,
    losses_by_step,
    replanned_figures_line,
    replans,
)
from tests.helpers.paths import ROOT
from tests.helpers.services import PUSHGATEWAY_URL, poll, require_prometheus
from tests.helpers.slurm_jobs import (
    ctx,
    job_dir,
    node_pids,
    run,
    status,
    submit,
    wait_for_agent_queue,
    wait_for_log,
)

TWO_NODES_HEALING = [
    "training.seq_len=512",
    "training.steps=60",
    "training.checkpoint.interval=4",
    "training.checkpoint.keep=100",
    "cluster.nodes=2",
    "cluster.gpus_per_node=1",
    "cluster.slurm.partition=low",
    "training.timeout_seconds=30",
    "training.heal.on_allocation_change=replan",
    "training.heal.min_nodes=1",
]
"""The demo at CP 2 over two nodes (one rank each), a checkpoint every 4 steps, all kept, and
free to run on one node."""

SLOW_STEPS = "kind=slow,seconds=2,restart=0-1"
"""The fault that holds each step of the dead-node job's first two runs 2 s longer."""

MEMORY_BOUND = [
    "model.layers=16",
    "training.seq_len=2048",
    "training.steps=3",
    "training.checkpoint.interval=4",
    "training.checkpoint.keep=100",
    "parallel.cp=1",
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "cluster.slurm.partition=debug",
    "training.activation_checkpointing=none",
]
"""The demo model 16 blocks deep at 2,048 tokens on one rank. What its job's memory cgroup
peaked at on the test cluster (memory.max_usage_in_bytes, two steps, fp32): 711 MiB without
activation checkpointing, 577 MiB with selective, 465 MiB with full; the planner predicts 0.74,
0.58 and 0.49 GiB."""
MEMORY_LIMIT = "650M"
"""Slurm --mem for MEMORY_BOUND: below its need without checkpointing, above it (and above the
planner's prediction) with selective or full."""


pytestmark = [pytest.mark.usefixtures("slurm"), pytest.mark.service_group("slurm_nodes")]


def complete(home: Path, tmp_path: Path, job_id: str, timeout: float = 300) -> dict:
    waited = ctx(
        home, tmp_path, "wait", job_id, "--timeout", str(timeout), "--poll", "1",
        timeout=timeout + 20,
    )  # fmt: skip
    assert waited.returncode == 0, waited.stdout + waited.stderr
    return status(home, tmp_path, job_id)


def wait_for_event(run_dir: Path, check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.5)


def reference_losses(
    tmp_path: Path, home: Path, name: str, checkpoint: Path | None, step: int, sets: list[str]
) -> dict[int, float]:
    """The losses of a fresh run at a layout (`sets`) from the checkpoint of `step` alone (a
    copy; None: from the start) to the job's last step, on Slurm like the healed one. The
    job's step count stays the healed run's: the learning-rate schedule follows it."""
    ckpt = tmp_path / f"{name}-ckpt"
    if checkpoint is not None:
        shutil.copytree(checkpoint / f"step-{step:08d}", ckpt / f"step-{step:08d}")
    job_id = submit(tmp_path, home, *sets, f"training.checkpoint.dir={ckpt}")
    final = complete(home, tmp_path, job_id)
    assert final["state"] == "COMPLETED", final
    return losses_by_step(job_dir(home, job_id) / "run")


def layout_sets(changes: dict, nodes: int) -> list[str]:
    """The `--set`s of a `replanned` event's layout (its `to` changes) on `nodes` nodes, with
    no healing (a plain run at that layout)."""
    sets = [f"{k}={json.dumps(v)}" for k, v in changes.items()]
    return [
        *sets,
        f"cluster.nodes={nodes}",
        "training.heal.on_allocation_change=wait",
        "training.heal.min_nodes=null",
    ]


@pytest.mark.timeout(900)
def test_a_dead_drained_node_shrinks_the_job_to_one_node_and_it_grows_back(
    tmp_path: Path, home: Path
) -> None:
    # Each step of the first two runs sleeps 2 s on top of its work (the `slow` fault; the
    # losses do not change): else the one-node stretch, 0.04 s a step, would finish the job
    # before node2 may take it back (slurmctld's retry list empties up to a minute after node2
    # answers; see below).
    job_id = submit(
        tmp_path,
        home,
        *TWO_NODES_HEALING,
        "cluster.slurm.max_restarts=3",
        CTXLAUNCH_INJECT_FAULT=SLOW_STEPS,
    )
    run_dir = job_dir(home, job_id) / "run"
    ckpt = tmp_path / "ckpt"
    # The first run must hold both nodes (node1 and node2 idle): else there is nothing to heal.
    wait_for_log(home, job_id, r"^ctxlaunch: job \d+ restart 0 on \d+ node", 150)
    first_run = ctx(home, tmp_path, "logs", job_id).stdout
    if "restart 0 on 2 node(s)" not in first_run:
        run(["scancel", job_id], home, tmp_path)
        pytest.fail(f"the first run did not get both nodes:\n{first_run[:2000]}")
    wait_for_log(home, job_id, r"^0: step 7/", timeout=150)
    # node2 dies at once (its slurmd, its step daemon, its rank), and the admin drains it.
    fault = time.time()
    for pid in node_pids("node2"):
        os.kill(pid, signal.SIGKILL)
    drained = run(
        ["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=heal-test"],
        home,
        tmp_path,
    )
    assert drained.returncode == 0, drained.stderr
    reached = last_step_before(run_dir, fault)
    try:
        # Slurm notices (SlurmdTimeout), requeues the job, and runs it on node1 alone.
        wait_for_log(home, job_id, r"healed: allocation of 1 node instead of 2", 180)
        (shrunk,) = replans(run_dir)
        first = wait_for_event(
            run_dir, lambda: first_step_after(run_dir, shrunk.time_seconds), 120, "step"
        )
        shown = status(home, tmp_path, job_id)
        assert shown["state"] == "RUNNING" and shown["restarts"] == 1, shown
        assert shown["nodes"] == "node1", shown
        assert shown["healing"][0].startswith("allocation of 1 node instead of 2 at step"), shown
        assert "with 2 nodes, cp 2 ring; resumed at step" in shown["healing"][0], shown
        resumed = shrunk.get("step")
        assert reached - 4 <= resumed <= reached and resumed % 4 == 0, (reached, resumed)
        assert shrunk.get("to")["changes"]["parallel.cp"] == 1
        print(
            figures_line(
                "dead and drained node (2 nodes -> 1)",
                steps_lost=reached - resumed,
                seconds_fault_to_first_step=round(first.time_seconds - fault, 1),
                reached=reached,
                resumed=resumed,
            )
        )
    finally:
        # node2 comes back: resumed by the admin, a fresh slurmd.
        run(["scontrol", "update", "NodeName=node2", "State=RESUME"], home, tmp_path)
        started = subprocess.run(
            [str(ROOT / "scripts/services/slurm.sh"), "start"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert started.returncode == 0, started.stderr
    # The signal that ended the dead node's step (srun's, when rank 0 failed) waits in
    # slurmctld's retry list until node2 answers, and then goes to whatever step of the job
    # holds that step ID there: delivered while the job runs on node1 alone, it finds none.
    # Delivered later, it would kill the grown run's rank on node2 before its first step.
    drained = wait_for_agent_queue(home, tmp_path)
    print(f"slurmctld's retry list empty {drained:.0f} s after node2 came back")
    # A later requeue (a stop signal: the ranks checkpoint the step in hand) gets both nodes.
    wait_for_log(home, job_id, rf"^0: step {resumed + 6}/", timeout=150)
    regrow = time.time()
    sent = run(["scancel", "--batch", "--signal=USR1", job_id], home, tmp_path)
    assert sent.returncode == 0, sent.stderr
    wait_for_log(home, job_id, r"healed: allocation grown back to 2 nodes from 1", 180)
    shrunk, grown = replans(run_dir)
    stopped = grown.get("step")
    assert stopped == last_step_before(run_dir, grown.time_seconds)  # nothing lost
    assert grown.get("to")["changes"]["parallel.cp"] == 2
    first_grown = wait_for_event(
        run_dir, lambda: first_step_after(run_dir, grown.time_seconds), 120, "step"
    )
    print(
        figures_line(
            "allocation grown back (1 node -> 2), after a stop signal",
            steps_lost=0,
            seconds_signal_to_first_step=round(first_grown.time_seconds - regrow, 1),
            resumed=stopped,
        )
    )
    final = complete(home, tmp_path, job_id)
    log = ctx(home, tmp_path, "logs", job_id).stdout
    told = f"{json.dumps(final, indent=1)}\n{log[-6000:]}"
    assert final["state"] == "COMPLETED" and final["restarts"] == 2, told
    assert final["history"][0].startswith("run 1: NODE_FAIL"), told
    assert final["history"][1].startswith("run 2: STOPPED by SIGUSR1 to the batch script"), told
    assert len(final["healing"]) == 2, told
    assert "0: ctxlaunch: done: 60 steps" in log
    shown = ctx(home, tmp_path, "status", job_id).stdout
    assert "healed: allocation of 1 node instead of 2" in shown, shown
    assert "healed: allocation grown back to 2 nodes from 1" in shown, shown
    # The stretch on one node is a fresh run at its layout from the same checkpoint.
    healed = losses_by_step(run_dir)
    fresh = reference_losses(
        tmp_path,
        home,
        "one-node",
        ckpt,
        resumed,
        [*TWO_NODES_HEALING, *layout_sets(shrunk.get("to")["changes"], 1)],
    )
    assert_same_losses(healed, fresh, range(resumed + 1, stopped + 1))


@pytest.mark.timeout(900)
@pytest.mark.service_group("slurm_host")  # its job runs on the host's node
def test_a_memory_limit_too_small_for_the_layout_is_replanned_to_one_that_fits(
    tmp_path: Path, home: Path
) -> None:
    require_prometheus()
    name = f"heal-mem-{uuid.uuid4().hex[:8]}"
    job_id = submit(
        tmp_path,
        home,
        *MEMORY_BOUND,
        f"name={name}",
        f"cluster.slurm.mem={MEMORY_LIMIT}",
        "training.heal.on_oom=replan",
        "telemetry.prometheus=push",
        f"telemetry.pushgateway_url={PUSHGATEWAY_URL}",
        "telemetry.push_interval_seconds=1",
    )
    run_dir = job_dir(home, job_id) / "run"
    wait_for_log(home, job_id, r"healed: OOM \(killed at the memory limit\)", 300)
    (replanned,) = replans(run_dir)
    # The step the kernel killed: Slurm's record of the first run's step.
    steps = run(
        ["sacct", "-j", job_id, "-D", "-n", "-P", "-o", "JobID,State,End"], home, tmp_path
    ).stdout.splitlines()
    killed = [line for line in steps if "|OUT_OF_MEMORY|" in line]
    assert killed, steps
    end = killed[0].split("|")[2]
    fault = float(subprocess.check_output(["date", "-d", end, "+%s"], text=True))
    first = wait_for_event(
        run_dir, lambda: first_step_after(run_dir, replanned.time_seconds), 120, "step"
    )
    final = complete(home, tmp_path, job_id)
    assert final["state"] == "COMPLETED" and final["restarts"] == 1, final
    assert final["history"][0].startswith("run 1: OOM"), final
    (story,) = final["healing"]
    # The kill strikes in one of the first steps (the first, or the second, where AdamW's
    # states are first allocated); no checkpoint was written yet, so the healed run starts at
    # step 0. The story names the step the killed run had in hand, where anything of it was
    # recorded before the kill.
    assert re.fullmatch(
        r"OOM \(killed at the memory limit\)( at step [12])? with checkpointing none; "
        r"resumed at step 0 with checkpointing (selective|full)",
        story,
    ), story
    reached = last_step_before(run_dir, fault)
    assert replanned.get("step") == 0, replanned.fields
    after = replanned.get("to")["changes"]["training.activation_checkpointing"]
    assert after in ("selective", "full"), replanned.fields
    figures = replanned.get("figures")
    assert figures["predicted_peak_bytes"] * figures["margin"] <= figures["capacity_bytes"]
    assert figures["capacity_bytes"] <= 650 * 2**20
    print(
        replanned_figures_line(
            f"memory limit too small for the layout (--mem {MEMORY_LIMIT})",
            replanned,
            first,
            fault,
            reached,
        )
    )
    # The re-plan is in Prometheus (pushed from the healed run).
    poll(
        f'ctxlaunch_replans_total{{job="{name}", why="oom", rank="0"}} == 1',
        timeout=60,
    )
    info = poll(f'ctxlaunch_replan_info{{job="{name}", rank="0"}}', timeout=30)
    assert info[0]["metric"]["to_layout"] == replanned.get("to")["layout"], info
    # The healed run is a fresh run at the new layout (the OOM struck before any checkpoint).
    healed = losses_by_step(run_dir)
    fresh = reference_losses(
        tmp_path,
        home,
        "fits",
        None,
        0,
        [*MEMORY_BOUND, *layout_sets(replanned.get("to")["changes"], 1)],
    )
    assert_same_losses(healed, fresh, range(1, 4))
