"""The embedded default: run the job on the local machine through torchrun, one process per
rank, streaming rank 0's log, and exit with the job's status."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ctxlaunch.contract import dirlock, events, exitcodes, lifeline
from ctxlaunch.contract.bounded import BoundedReadError, read_bounded_bytes
from ctxlaunch.contract.events import LOCAL_RESTART_COUNT_ENV
from ctxlaunch.contract.heal_log import describe_replan, restarts_for_oom
from ctxlaunch.contract.rundir import (
    EXIT_DIR,
    JOB_ID_ENV,
    TRAINING,
    JobEntry,
    cpu_threads_per_rank,
    rank_exit_codes,
    spec_json,
)
from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.contract.spec.secret_refs import env_references
from ctxlaunch.launch import jobstore
from ctxlaunch.launch.backends.base import (
    EXIT_STATES,
    Backend,
    DryRun,
    Status,
    combine_exit_codes,
)
from ctxlaunch.launch.env_references import resolve as resolve_references
from ctxlaunch.launch.request import job_environment, ranks_per_node_of

RANK_PREFIX = "[rank0]:"
MAX_LOG_BYTES = 16 << 20
"""How much of a rank's log `logs` and `status` read: its last 16 MiB."""


class LocalBackend(Backend):
    """This machine: torchrun in the foreground of `ctxlaunch submit`."""

    name = "local"
    runs_here = True

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable

    def dryrun(self, spec: JobSpec, entry: JobEntry = TRAINING) -> DryRun:
        """torchrun on the job's entry (the trainer, one process per rank), in a new record
        directory."""
        job_id = jobstore.new_id("local", spec.name)
        directory = jobstore.jobs_root() / job_id
        ranks = ranks_per_node_of(spec, entry)
        command = [
            self.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={ranks}",
            "--role=rank",
            "--tee=3",
            f"--log-dir={directory / 'torchrun'}",
            "--local-ranks-filter=0",
            "-m",
            entry.module,
            str(directory / "spec.json"),
            "--run-dir",
            str(directory),
            *entry.args,
        ]
        env = job_environment(spec)
        if spec.cluster.gpu == "cpu":
            env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(ranks))
        env[JOB_ID_ENV] = job_id
        return DryRun(
            env_references=env_references(spec.fabric.env),
            target="local",
            spec=spec,
            job_id=job_id,
            command=command,
            env=env,
            artifact=spec_json(spec) + "\n",
            artifact_name="spec.json",
            entry=entry,
        )

    def schedule(
        self, dryrun: DryRun, out: IO[str] | None = None, err: IO[str] | None = None
    ) -> int:
        """Run the job here, streaming rank 0's lines; returns the job's exit status."""
        return int(self.submit(dryrun, out, err).extra["exit_status"])

    def submit(
        self, dryrun: DryRun, out: IO[str] | None = None, err: IO[str] | None = None
    ) -> jobstore.JobRecord:
        """Run the job here, streaming rank 0's lines; returns its record, with its exit
        status, once it has ended."""
        out = out or sys.stdout
        err = err or sys.stderr
        # Read now, before anything is started or written; held only in the ranks' environment.
        referenced = resolve_references(dryrun.env_references)
        spec = dryrun.spec
        job_id = dryrun.job_id
        if spec.training.checkpoint.dir:
            # Refused here, before a record exists; the first rank takes the directory itself.
            dirlock.check_free(spec.training.checkpoint.dir)
        record = jobstore.JobRecord(
            id=job_id,
            name=spec.name,
            target="local",
            created=time.time(),
            backend_id=job_id,
            command=dryrun.command,
            artifact="spec.json",
            # Who runs the job: once it is gone without recording an end, the job is LOST
            # (told only on its host: a home shared between machines holds others' jobs).
            extra={"launcher": str(lifeline.this_process()), "host": socket.gethostname()},
        )
        directory = record.directory
        ranks = ranks_per_node_of(spec, dryrun.entry)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "spec.json").write_text(dryrun.artifact or "")
        jobstore.save(record)
        print(
            f"ctxlaunch: local job {job_id} ({ranks} ranks); logs and metrics in {directory}",
            file=err,
            flush=True,
        )
        heal = spec.training.heal
        attempt = 0
        while True:
            # ctxlaunch's own variables last: nothing from the spec replaces them.
            env = {**os.environ, **dryrun.env, **referenced, **lifeline.launcher_env()}
            env[JOB_ID_ENV] = job_id
            if attempt:
                env[LOCAL_RESTART_COUNT_ENV] = str(attempt)
            returncode = _run_torchrun(dryrun.command, env, directory, attempt, out, err)
            codes = rank_exit_codes(directory, ranks)
            status = combine_exit_codes(codes) if returncode else exitcodes.OK
            if (
                status == exitcodes.OOM
                and heal.on_oom == "replan"
                and restarts_for_oom(spec.training.checkpoint.dir, heal.max_replans)
            ):
                attempt += 1
                print(
                    "ctxlaunch: out of memory (rank exit codes "
                    + ", ".join("killed" if c is None else str(c) for c in codes)
                    + f"); training.heal re-plans the layout and restarts the job from its "
                    f"newest checkpoint (restart {attempt})",
                    file=err,
                    flush=True,
                )
                for stale in (directory / EXIT_DIR).glob("*"):
                    stale.unlink(missing_ok=True)
                continue
            break
        record.extra["exit_status"] = status
        record.extra["rank_exit_codes"] = codes
        record.extra["restarts"] = attempt
        jobstore.save(record)
        if status != exitcodes.OK:
            _report_failure(directory, codes, status, err)
        return record

    # -- an existing job ------------------------------------------------------------------------
    # A local job runs in the foreground of `ctxlaunch submit`; afterwards its record says how
    # it ended and torchrun's log directory holds every rank's output.
    def status(self, record: jobstore.JobRecord) -> Status:
        """How the job ended, from its record: RUNNING until `submit` wrote it, LOST when the
        `submit` that ran it is gone without having written it."""
        code = record.extra.get("exit_status")
        happened = events.read_events(record.directory)
        healed = tuple(
            describe_replan(event.fields) for event in happened if event.kind == events.REPLANNED
        )
        restarts = _count(record.extra.get("restarts"))
        if code is None:
            launcher = lifeline.ProcessId.parse(record.extra.get("launcher"))
            here = record.extra.get("host") == socket.gethostname()
            if launcher is not None and here and not launcher.alive():
                return Status(
                    state="LOST",
                    restarts=restarts,
                    story=lost_story(launcher, happened),
                    healing=healed,
                )
            return Status(state="RUNNING", restarts=restarts, healing=healed)
        if not isinstance(code, int) or isinstance(code, bool):
            raise ValueError(f"damaged job record {record.directory}: exit_status is not a number")
        state = EXIT_STATES.get(code, "FAILED")
        story = (
            f"{state} after {len(healed)} re-plan(s): " + "; then ".join(healed) if healed else ""
        )
        return Status(state=state, exit_code=code, restarts=restarts, story=story, healing=healed)

    def read_log(self, record: jobstore.JobRecord, rank: int | None = None) -> list[str]:
        """Rank `rank`'s (default 0) output, from torchrun's log directory."""
        lines: list[str] = []
        for stream in ("stdout", "stderr"):
            # One torchrun directory per run (a restart under training.heal adds one): oldest
            # first.
            for path in sorted(
                record.directory.glob(
                    f"torchrun/*/attempt_*/{rank if rank is not None else 0}/{stream}.log"
                ),
                key=lambda found: (found.stat().st_mtime, str(found)),
            ):
                try:
                    data = read_bounded_bytes(path, MAX_LOG_BYTES, "the rank's log", tail=True)
                except BoundedReadError:
                    continue  # not a log torchrun wrote (a FIFO, a directory): nothing to show
                lines += data.decode("utf-8", errors="replace").splitlines(keepends=True)
        return lines

    def follow_log(self, record: jobstore.JobRecord, rank: int | None = None) -> Iterator[str]:
        """The log as it is: a local job is over by the time another command can ask."""
        return iter(self.read_log(record, rank))

    def cancel(self, record: jobstore.JobRecord) -> None:
        """A local job cannot be cancelled from another command."""
        raise RuntimeError(
            "a local job runs in the foreground of `ctxlaunch submit`: stop it there (Ctrl-C)"
        )

    def explain(self, record: jobstore.JobRecord, status: Status) -> list[str]:
        """The first failing rank's last lines."""
        codes = record.extra.get("rank_exit_codes")
        for rank, code in enumerate(codes if isinstance(codes, list) else []):
            if code not in (exitcodes.OK, exitcodes.PREEMPTED):
                tail = [line.rstrip() for line in self.read_log(record, rank)[-15:]]
                return [f"rank {rank} exited {code}; its last lines:"] + tail
        return []


def _count(value: object) -> int:
    """A count from a record (0 where it holds none, or no count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def lost_story(launcher: lifeline.ProcessId, happened: list[events.Event]) -> str:
    """Why a local job with no recorded end is over, and where it got to (its events)."""
    steps = [e.get("step") for e in happened if e.kind == events.STEP]
    saved = [e for e in happened if e.kind == events.CHECKPOINT]
    reached = f"its last logged step was {steps[-1]}" if steps else "it logged no step"
    newest = (
        f"the newest checkpoint is step {saved[-1].get('step')} ({saved[-1].get('path')})"
        if saved
        else "it wrote no checkpoint"
    )
    return (
        f"the `ctxlaunch submit` that ran it (pid {launcher.pid}) ended without recording how "
        f"the job ended (killed, or its machine restarted), and its ranks ended with it; "
        f"{reached}, {newest}"
    )


def _run_torchrun(
    command: list[str],
    env: dict[str, str],
    directory: Path,
    attempt: int,
    out: IO[str],
    err: IO[str],
) -> int:
    """Run torchrun once, rank 0's lines to the console and its own to torchrun.log (appended
    to by each restart); returns its exit status."""
    with open(directory / "torchrun.log", "a" if attempt else "w", encoding="utf-8") as agent:
        process = subprocess.Popen(
            command,
            env=env,
            # torchrun dies with this process (and each rank with torchrun: runtime.tether).
            preexec_fn=lifeline.child_of(os.getpid()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        pumps = [
            threading.Thread(target=_pump, args=(process.stdout, out, agent), daemon=True),
            threading.Thread(target=_pump, args=(process.stderr, err, agent), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        try:
            process.wait()
        except KeyboardInterrupt:
            process.terminate()
            process.wait()
        for pump in pumps:
            pump.join()
    return process.returncode


def _pump(stream: IO[str], console: IO[str], agent: IO[str]) -> None:
    """Rank 0's lines (prefixed by torchrun) go to the console without the prefix; the agent's
    own chatter goes to torchrun.log."""
    for line in stream:
        if line.startswith(RANK_PREFIX):
            console.write(line[len(RANK_PREFIX) :])
            console.flush()
        else:
            agent.write(line)
            agent.flush()


def _report_failure(directory: Path, codes: list[int | None], status: int, err: IO[str]) -> None:
    names = {
        exitcodes.OOM: "out of memory",
        exitcodes.PREEMPTED: "preempted (checkpointed)",
        exitcodes.BAD_INPUT: "rejected its input",
        exitcodes.FAILED: "failed",
    }
    print(
        f"ctxlaunch: job {names.get(status, 'failed')} (exit {status}); rank exit codes: "
        + ", ".join("killed" if c is None else str(c) for c in codes),
        file=err,
    )
    for rank, code in enumerate(codes):
        if code in (exitcodes.OK, exitcodes.PREEMPTED) or rank == 0:
            continue
        logs = sorted(directory.glob(f"torchrun/*/attempt_*/{rank}/stderr.log"))
        if logs:
            try:
                data = read_bounded_bytes(logs[-1], MAX_LOG_BYTES, "the rank's log", tail=True)
            except BoundedReadError:
                continue
            tail = data.decode("utf-8", errors="replace").splitlines()[-15:]
            print(f"--- rank {rank} stderr (last lines of {logs[-1]}) ---", file=err)
            print("\n".join(tail), file=err)
    err.flush()
