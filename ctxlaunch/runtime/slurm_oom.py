"""`python -m ctxlaunch.runtime.slurm_oom STATUS`: what a healing job's Slurm batch script asks
after its srun ended with STATUS: did the step run out of memory, and is the job to be requeued
to re-plan? Exit 0: yes (the OOM is in the heal log for the next run); 1: no.

Two ways a step runs out of memory: the trainer caught the device's OutOfMemoryError, recorded
it and exited 86; or the kernel's OOM killer ended a rank at the step's memory limit (--mem:
task/cgroup puts the step in a memory cgroup), which leaves no status of its own. Slurm knows
the second: the step's accounting state is OUT_OF_MEMORY (slurmstepd counts the cgroup's
oom_kill events), read here with sacct, which can lag the step's end by a few seconds. Such
an OOM is recorded here, in the heal log and the run's events, with the rank's share of the
limit as what it needed at least.

Only a job with training.heal.on_oom replan asks; the re-plans it has left decide (a job out of
them stays ended, OOM).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ctxlaunch.contract import events, exitcodes
from ctxlaunch.contract.heal_log import OomEntry, record_oom, restarts_for_oom
from ctxlaunch.contract.rundir import RUN_DIR_ENV, SPEC_ENV

OUT_OF_MEMORY = "OUT_OF_MEMORY"
ACCOUNTING_WAIT_SECONDS = 20.0
"""How long to wait for the step's accounting record: sacct shows a step's end only once
slurmctld has passed it to slurmdbd, seconds after the step ended, and later on a busy
controller; the wait allows several times the usual lag (BENCHMARKS.md, faults: Slurm faults).
A step whose record has not come by then is taken as not out of memory: no re-plan."""
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", OUT_OF_MEMORY)


def step_states(job_id: str, run: Callable[..., subprocess.CompletedProcess] = subprocess.run):
    """The states of the current run's steps of the job ({step id: state}), from sacct."""
    result = run(
        ["sacct", "-j", job_id, "-n", "-P", "-o", "JobID,State"],
        capture_output=True,
        text=True,
    )
    states: dict[str, str] = {}
    if result.returncode != 0:
        return states
    for line in result.stdout.splitlines():
        job_step, _, state = line.partition("|")
        step = job_step.split(".", 1)[1] if "." in job_step else ""
        if step.isdigit():
            states[step] = state.split()[0] if state else ""
    return states


def step_ran_out_of_memory(
    job_id: str, wait_seconds: float = ACCOUNTING_WAIT_SECONDS, poll_seconds: float = 0.5
) -> bool:
    """Whether a step of the job's current run ended OUT_OF_MEMORY, waiting up to
    `wait_seconds` for the accounting to record the steps' ends."""
    deadline = time.monotonic() + wait_seconds
    while True:
        states = step_states(job_id)
        if any(state == OUT_OF_MEMORY for state in states.values()):
            return True
        settled = states and all(state in TERMINAL for state in states.values())
        if settled or time.monotonic() > deadline:
            return False
        time.sleep(poll_seconds)


def mem_per_rank_bytes(environ: dict[str, str] | os._Environ, ranks_per_node: int) -> int | None:
    """The rank's share of the job's --mem (SLURM_MEM_PER_NODE, MiB), if it has one."""
    try:
        per_node = int(environ.get("SLURM_MEM_PER_NODE") or 0) * 2**20
    except ValueError:
        return None
    return per_node // max(ranks_per_node, 1) if per_node else None


def steps_of_this_run(run_dir: Path) -> list[int]:
    """The steps the run that just ended logged (its `step` events since its `started`)."""
    steps: list[int] = []
    for event in events.read_events(run_dir):
        if event.kind == events.STARTED:
            steps = []
        elif event.kind == events.STEP:
            steps.append(int(event.get("step")))
    return steps


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].lstrip("-").isdigit():
        print("usage: python -m ctxlaunch.runtime.slurm_oom STATUS", file=sys.stderr)
        return exitcodes.BAD_INPUT
    status = int(args[0])
    from ctxlaunch.contract.loader import SpecError, parse_yaml, validate_spec

    try:
        spec = validate_spec(parse_yaml(os.environ.get(SPEC_ENV, ""), f"${SPEC_ENV}"))
    except SpecError as exc:
        print(f"ctxlaunch: {exc}", file=sys.stderr)
        return exitcodes.FAILED
    heal = spec.training.heal
    directory = spec.training.checkpoint.dir
    if heal.on_oom != "replan" or directory is None or status == exitcodes.OK:
        return exitcodes.FAILED
    run_dir = Path(os.environ.get(RUN_DIR_ENV) or ".")
    if status != exitcodes.OOM:
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if not job_id or not step_ran_out_of_memory(job_id):
            return exitcodes.FAILED
        steps = steps_of_this_run(run_dir)
        share = mem_per_rank_bytes(os.environ, spec.cluster.gpus_per_node)
        message = (
            f"a rank was killed by the kernel's OOM killer at the step's memory limit "
            f"(Slurm step state {OUT_OF_MEMORY}, srun exit {status})"
        )
        record_oom(
            directory,
            OomEntry(
                source="cgroup",
                phase="killed",
                step=int(steps[-1]) + 1 if steps else None,
                capacity_bytes=share,
                message=message,
            ),
        )
        events.append_event(
            run_dir,
            events.OOM,
            rank=-1,
            step=int(steps[-1]) + 1 if steps else None,
            message=message,
            phase="killed",
            figures={"limit_per_rank_bytes": share},
        )
    return exitcodes.OK if restarts_for_oom(directory, heal.max_replans) else exitcodes.FAILED


if __name__ == "__main__":
    sys.exit(main())
