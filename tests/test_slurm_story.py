"""`status` tells a requeued job's story from the batch script's log lines and Slurm's record
of each run (the lines below are the ones the rendered script and the trainer print)."""

from __future__ import annotations

from ctxlaunch.launch.backends.base import Status
from ctxlaunch.launch.backends.slurm import runs_from_log, tell_story

LOG = """ctxlaunch: job 7 restart 0 on 2 node(s), rendezvous node1:20007
0: ctxlaunch: checkpoint /c/step-00000004
0: ctxlaunch: stop signal received; checkpointed at step 6, exiting 75 to be requeued
0: ctxlaunch: checkpoint /c/step-00000006
ctxlaunch: stopped by preemption (exit 75); requeueing job 7 (restart 1 of 3)
ctxlaunch: job 7 restart 1 on 2 node(s), rendezvous node1:20007
0: ctxlaunch: resumed from /c/step-00000006
0: ctxlaunch: checkpoint /c/step-00000008
srun: error: Node failure on node2
ctxlaunch: job 7 restart 2 on 2 node(s), rendezvous node1:20007
""".splitlines(keepends=True)


def test_runs_from_log_reads_checkpoints_and_causes() -> None:
    assert runs_from_log(LOG) == [{"checkpoint": 6, "cause": "preemption"},
                                  {"checkpoint": 8, "cause": ""},
                                  {"checkpoint": 8, "cause": ""}]


def test_a_running_requeued_job_says_why_and_where_it_resumes() -> None:
    status = tell_story(Status(state="RUNNING", restarts=2), LOG,
                        ["REQUEUED", "NODE_FAIL", "RUNNING"], max_restarts=3)
    assert status.story == "NODE_FAIL and requeued (restart 2 of 3); resumes from step 8"
    assert status.history == ("run 1: PREEMPTED, checkpoint at step 6, requeued",
                              "run 2: NODE_FAIL, checkpoint at step 8, requeued")


def test_final_states_in_words() -> None:
    done = tell_story(Status(state="COMPLETED", restarts=2), LOG,
                      ["REQUEUED", "NODE_FAIL", "COMPLETED"], 3)
    assert done.story == "COMPLETED after 2 restart(s): PREEMPTED, NODE_FAIL"
    cancelled = tell_story(Status(state="CANCELLED"), LOG[:2], ["CANCELLED"], 3)
    assert cancelled.story == "CANCELLED by the user (scancel); the newest checkpoint is step 4"
    timeout = tell_story(Status(state="TIMEOUT"), LOG[:2], ["TIMEOUT"], 3)
    assert timeout.story == "TIMEOUT after a checkpoint at step 4; resubmit to resume from it"
    node_fail = tell_story(Status(state="FAILED", scheduler_state="NODE_FAIL"), LOG[:2],
                           ["NODE_FAIL"], 3)
    assert node_fail.story.startswith("NODE_FAIL: a node of the job failed")
