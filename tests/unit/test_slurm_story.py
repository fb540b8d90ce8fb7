"""`status` tells a requeued job's story from the job's events and Slurm's record of each run
(the events below are the ones the trainer and the rendered script's requeue line write)."""

from __future__ import annotations

from ctxlaunch.contract.events import parse_events
from ctxlaunch.launch.backends.base import Status
from ctxlaunch.launch.backends.slurm import runs_from_events, tell_story

# A job preempted in its first run (requeued by its script), then a node failure (requeued by
# Slurm: no requeue event), now in its third run.
LOG = parse_events(
    [
        '{"event":"started","time":1,"restart":0,"world_size":2}',
        '{"event":"checkpoint","time":2,"step":4,"path":"/c/step-00000004"}',
        '{"event":"stop_signal","time":3,"step":6}',
        '{"event":"checkpoint","time":3,"step":6,"path":"/c/step-00000006"}',
        '{"event":"requeue","time":4,"restart":0,"cause":"preemption","exit":75}',
        '{"event":"started","time":5,"restart":1,"world_size":2}',
        '{"event":"checkpoint","time":6,"step":8,"path":"/c/step-00000008"}',
        '{"event":"started","time":7,"restart":2,"world_size":2}',
    ]
)


def test_runs_from_events_reads_checkpoints_and_causes() -> None:
    assert runs_from_events(LOG) == [
        {"checkpoint": 6, "cause": "preemption"},
        {"checkpoint": 8, "cause": ""},
        {"checkpoint": 8, "cause": ""},
    ]


def test_a_running_requeued_job_says_why_and_where_it_resumes() -> None:
    status = tell_story(
        Status(state="RUNNING", restarts=2),
        LOG,
        ["REQUEUED", "NODE_FAIL", "RUNNING"],
        max_restarts=3,
    )
    assert status.story == "NODE_FAIL and requeued (restart 2 of 3); resumes from step 8"
    assert status.history == (
        "run 1: PREEMPTED, checkpoint at step 6, requeued",
        "run 2: NODE_FAIL, checkpoint at step 8, requeued",
    )


def test_final_states_in_words() -> None:
    done = tell_story(
        Status(state="COMPLETED", restarts=2), LOG, ["REQUEUED", "NODE_FAIL", "COMPLETED"], 3
    )
    assert done.story == "COMPLETED after 2 restart(s): PREEMPTED, NODE_FAIL"
    cancelled = tell_story(Status(state="CANCELLED"), LOG[:2], ["CANCELLED"], 3)
    assert cancelled.story == "CANCELLED by the user (scancel); the newest checkpoint is step 4"
    timeout = tell_story(Status(state="TIMEOUT"), LOG[:2], ["TIMEOUT"], 3)
    assert timeout.story == "TIMEOUT after a checkpoint at step 4; resubmit to resume from it"
    node_fail = tell_story(
        Status(state="FAILED", scheduler_state="NODE_FAIL"), LOG[:2], ["NODE_FAIL"], 3
    )
    assert node_fail.story.startswith("NODE_FAIL: a node of the job failed")
