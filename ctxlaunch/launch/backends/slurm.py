"""Slurm: submit the rendered sbatch script with `sbatch --parsable`, then watch, read, cancel
and wait.

A training job's script is byte for byte what `ctxlaunch render --target slurm` writes for
the same spec (the same request and template), with the trainer started by this Python and the
logs, metrics, exit statuses and events kept in the job's record directory; it goes in with
`sbatch --parsable`, the artifact users read and can submit by hand. A function job, whose
return value comes back (the calibration job: it measures a node and returns its profile), goes
through submitit's executor instead, with the batch script's own sbatch options on one node
and the same environment (launch.request.slurm_function_request), and its result is read back
from submitit's files.
States come from Slurm itself (scontrol while the controller remembers the job, sacct after)
through one table, and a requeued job's story from the job's events.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ctxlaunch.contract import events, exitcodes
from ctxlaunch.contract.fsutil import umasked
from ctxlaunch.contract.heal_log import describe_replan
from ctxlaunch.contract.rundir import JOB_ID_ENV, TRAINING, JobEntry
from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.launch import jobstore
from ctxlaunch.launch.backends.base import Backend, DryRun, Status, SweepJobs, describe_layout
from ctxlaunch.launch.render import render_request
from ctxlaunch.launch.request import slurm_function_request, slurm_request

# Slurm's job states -> ctxlaunch's. The trainer's own exit statuses refine FAILED below.
STATES: dict[str, str] = {
    "PENDING": "PENDING",
    "CONFIGURING": "PENDING",
    "REQUEUED": "PENDING",
    "REQUEUE_HOLD": "PENDING",
    "REQUEUE_FED": "PENDING",
    "RESV_DEL_HOLD": "PENDING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "SIGNALING": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "RESIZING": "RUNNING",
    "SUSPENDED": "SUSPENDED",
    "STOPPED": "SUSPENDED",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "NODE_FAIL": "FAILED",
    "BOOT_FAIL": "FAILED",
    "SPECIAL_EXIT": "FAILED",
    "REVOKED": "FAILED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
    "DEADLINE": "TIMEOUT",
    "PREEMPTED": "PREEMPTED",
    "OUT_OF_MEMORY": "OUT_OF_MEMORY",
}


@dataclass(frozen=True)
class ModuleFunction:
    """A function named by its module, for submitit to pickle and call on a Slurm node: the
    module is imported only there, so the launcher never imports the job's code (the runtime
    layer) itself."""

    module: str
    function: str

    def __call__(self, *args: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.function)(*args)


class SlurmError(RuntimeError):
    """Slurm refused or failed a request; the message is Slurm's own."""


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def query_status(job_id: str) -> Status:
    """The job's state: scontrol while the controller holds it, else the accounting database."""
    result = _run(["scontrol", "show", "job", "--oneliner", job_id])
    if result.returncode == 0 and result.stdout.strip():
        fields = dict(re.findall(r"(\w+)=(\S*)", result.stdout))
        raw = fields.get("JobState", "UNKNOWN")
        exit_code = int(fields.get("ExitCode", "0:0").split(":")[0])
        return _classify(
            raw,
            exit_code,
            int(fields.get("Restarts", "0") or 0),
            fields.get("Reason", ""),
            fields.get("NodeList", ""),
        )
    result = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,NodeList"])
    line = result.stdout.strip().splitlines()[-1:] if result.returncode == 0 else []
    if not line:
        raise KeyError(job_id)
    state, exit_field, nodes = (line[0].split("|") + ["", "", ""])[:3]
    raw = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0"
    return _classify(raw, int(exit_field.split(":")[0] or 0), 0, "", nodes)


def run_states(job_id: str) -> list[str]:
    """Slurm's state for each run of the job, oldest first (sacct --duplicates): a run that
    Slurm requeued itself shows why (NODE_FAIL, PREEMPTED), one the script requeued REQUEUED."""
    result = _run(["sacct", "-j", job_id, "-X", "-D", "-n", "-P", "-o", "State"])
    if result.returncode != 0:
        return []
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


_CAUSE_WORDS = {"preemption": "PREEMPTED", "the time limit": "TIMEOUT", "out of memory": "OOM"}
"""The batch script's requeue causes that have a state's name."""


def runs_from_events(job_events: list[events.Event]) -> list[dict]:
    """One entry per run of the job, by restart count: the newest checkpoint at its end, and
    the cause when its batch script requeued it. A run that left no `started` event (it died
    before the trainer came up) carries the checkpoint of the run before it."""
    runs: list[dict] = []
    for event in job_events:
        if event.kind == events.STARTED:
            restart = int(event.get("restart", len(runs)))
            while len(runs) <= restart:
                runs.append({"checkpoint": runs[-1]["checkpoint"] if runs else None, "cause": ""})
        elif runs and event.kind == events.CHECKPOINT:
            runs[-1]["checkpoint"] = int(event.get("step"))
        elif runs and event.kind == events.REQUEUE:
            runs[min(int(event.get("restart", len(runs) - 1)), len(runs) - 1)]["cause"] = str(
                event.get("cause", "")
            )
    return runs


def tell_story(
    status: Status, job_events: list[events.Event], states: list[str], max_restarts: int
) -> Status:
    """The status in words a user trusts: how each earlier run ended (from the job's events,
    else from Slurm's record of that run) and what the current state means."""
    import dataclasses

    runs = runs_from_events(job_events)
    restarts = max(status.restarts, len(states) - 1, 0)
    history = []
    for index in range(restarts):
        run = runs[index] if index < len(runs) else {"checkpoint": None, "cause": ""}
        state = states[index] if index < len(states) else ""
        if run["cause"]:
            word = _CAUSE_WORDS.get(run["cause"], f"STOPPED by {run['cause']}")
        else:
            word = state or "REQUEUED"
        saved = (
            f"checkpoint at step {run['checkpoint']}"
            if run["checkpoint"] is not None
            else "no checkpoint yet"
        )
        history.append(f"run {index + 1}: {word}, {saved}, requeued")
    newest = next((r["checkpoint"] for r in reversed(runs) if r["checkpoint"] is not None), None)
    saved = (
        f"the newest checkpoint is step {newest}"
        if newest is not None
        else "no checkpoint was written"
    )
    story = ""
    if not status.terminal and restarts:
        last = history[-1].split(": ", 1)[1].split(",")[0]
        story = (
            f"{last} and requeued (restart {restarts} of {max_restarts}); "
            f"resumes from step {newest}"
            if newest is not None
            else f"{last} and requeued (restart {restarts} of {max_restarts})"
        )
    elif status.state == "COMPLETED" and restarts:
        story = f"COMPLETED after {restarts} restart(s): " + ", ".join(
            h.split(": ", 1)[1].split(",")[0] for h in history
        )
    elif status.state == "CANCELLED":
        story = f"CANCELLED by the user (scancel); {saved}"
    elif status.state == "TIMEOUT":
        story = (
            f"TIMEOUT after a checkpoint at step {newest}; resubmit to resume from it"
            if newest is not None
            else "TIMEOUT before any checkpoint"
        )
    elif status.scheduler_state == "NODE_FAIL":
        story = f"NODE_FAIL: a node of the job failed and the job was not requeued; {saved}"
    elif status.state == "PREEMPTED":
        story = f"PREEMPTED and not requeued; {saved}"
    elif status.state == "FAILED" and restarts >= max_restarts and restarts:
        story = f"FAILED after {restarts} restart(s), the limit; {saved}"
    healing = tuple(
        describe_replan(event.fields) for event in job_events if event.kind == events.REPLANNED
    )
    return dataclasses.replace(
        status, restarts=restarts, story=story, history=tuple(history), healing=healing
    )


def _classify(raw: str, exit_code: int, restarts: int, reason: str, nodes: str) -> Status:
    state = STATES.get(raw, raw)
    if state == "FAILED" and exit_code == exitcodes.OOM:
        state = "OOM"
    elif state == "FAILED" and exit_code == exitcodes.BAD_INPUT:
        state = "BAD_INPUT"
    return Status(
        state=state,
        scheduler_state=raw,
        exit_code=exit_code,
        restarts=restarts,
        reason=reason if reason not in ("None", "(null)") else "",
        nodes=nodes,
    )


def sbatch_submit(script_path: Path) -> str:
    """Submit a batch script; returns Slurm's job id. SlurmError with sbatch's own words when
    it refuses."""
    result = _run(["sbatch", "--parsable", str(script_path)])
    if result.returncode != 0:
        raise SlurmError(_sbatch_message(result.stderr or result.stdout))
    # --parsable: "<job id>" or "<job id>;<cluster>" on the last line.
    return result.stdout.strip().splitlines()[-1].split(";")[0]


def array_key(spec: JobSpec) -> tuple:
    """What the scripts of specs that can share one job array have in common: resources,
    environment, srun arguments and the requeue rule (their specs and names differ)."""
    request = slurm_request(spec, job_name="sweep")
    return (
        tuple(request.directives),
        tuple(request.env.items()),
        tuple(request.srun_args),
        request.max_restarts,
        request.requeue,
    )


class SlurmBackend(Backend):
    """A Slurm cluster, through its commands (sbatch, scontrol, sacct, scancel)."""

    name = "slurm"
    artifact_mode = 0o755  # the batch script is a program: sbatch and a user may run it

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable

    def scheduler_name(self, record: jobstore.JobRecord) -> str:
        """Slurm's states are Slurm's own (JobState)."""
        return "Slurm"

    def dryrun(self, spec: JobSpec, entry: JobEntry = TRAINING) -> DryRun:
        """The batch script for `spec`, in a new record directory; for a function entry, the
        submitit executor's parameters and the call."""
        if entry.function is not None:
            return self._function_dryrun(spec, entry)
        return self._script_dryrun(spec.name, spec, None)

    def _function_dryrun(self, spec: JobSpec, entry: JobEntry) -> DryRun:
        """What submitit is asked to do, as data: the executor's parameters, the setup lines
        and the function call (submitit writes the batch script itself when it submits)."""
        import json

        record_id = jobstore.new_id("slurm", spec.name)
        request = slurm_function_request(spec, entry)
        call = {
            "executor": "submitit.SlurmExecutor",
            "folder": str(jobstore.jobs_root() / record_id),
            "python": self.python,
            "parameters": request.parameters,
            "setup": request.setup,
            "function": f"{request.module}.{request.function}",
            "arguments": ["<the spec, as JSON>", *request.args[1:]],
        }
        return DryRun(
            target="slurm",
            spec=spec,
            job_id=record_id,
            command=["submitit", f"{request.module}.{request.function}"],
            env={JOB_ID_ENV: record_id},
            artifact=json.dumps(call, indent=2) + "\n",
            artifact_name="submitit.json",
            entry=entry,
        )

    def _script_dryrun(self, name: str, spec: JobSpec, array: list[JobSpec] | None) -> DryRun:
        """The script for one job (array None) or a job array, in a new record directory."""
        record_id = jobstore.new_id("slurm", name)
        directory = jobstore.jobs_root() / record_id
        request = slurm_request(
            spec,
            python=self.python,
            run_dir=str(directory / "run"),
            log_dir=str(directory),
            array=array,
            job_name=name,
        )
        script_name = f"{name}.sbatch"
        return DryRun(
            target="slurm",
            spec=spec,
            job_id=record_id,
            command=["sbatch", str(directory / script_name)],
            env={JOB_ID_ENV: record_id},
            artifact=render_request(request, "slurm", script_name),
            artifact_name=script_name,
        )

    @staticmethod
    def _submit(dryrun: DryRun) -> tuple[Path, str]:
        """Write the dry run's script into its record directory and submit it; returns
        (directory, Slurm job id). A refusal leaves no directory behind."""
        directory = jobstore.jobs_root() / dryrun.job_id
        directory.mkdir(parents=True)
        (directory / "run").mkdir()
        script_path = directory / (dryrun.artifact_name or "job.sbatch")
        script_path.write_text(dryrun.artifact or "")
        script_path.chmod(umasked(0o755))
        try:
            return directory, sbatch_submit(script_path)
        except (SlurmError, OSError) as exc:  # OSError: no sbatch on the submitting machine
            _remove_tree(directory)
            if isinstance(exc, SlurmError):
                raise
            raise SlurmError(f"sbatch cannot be run: {exc}") from None

    def schedule(self, dryrun: DryRun, err: IO[str] | None = None) -> int:
        """Submit the job and record it; prints Slurm's job id."""
        record = self.submit(dryrun, err)
        print(record.backend_id, flush=True)
        return exitcodes.OK

    def submit(self, dryrun: DryRun, err: IO[str] | None = None) -> jobstore.JobRecord:
        """Submit the script (or the function, through submitit) and record the job; returns
        its record."""
        err = err or sys.stderr
        if dryrun.entry.function is not None:
            record = self._submit_function(dryrun)
        else:
            record = self._submit_script(dryrun)
        print(
            f"ctxlaunch: submitted Slurm job {record.backend_id} ({record.id}); follow it with "
            f"`ctxlaunch logs {record.backend_id} --follow`",
            file=err,
            flush=True,
        )
        return record

    def _submit_script(self, dryrun: DryRun) -> jobstore.JobRecord:
        directory, slurm_id = self._submit(dryrun)
        record = jobstore.JobRecord(
            id=directory.name,
            name=dryrun.spec.name,
            target="slurm",
            created=time.time(),
            backend_id=slurm_id,
            command=dryrun.command,
            artifact=dryrun.artifact_name,
            extra={
                "log": str(directory / f"{dryrun.spec.name}-{slurm_id}.out"),
                "run_dir": str(directory / "run"),
                "spec": dryrun.spec.model_dump(mode="json"),
            },
        )
        jobstore.save(record)
        return record

    def _submit_function(self, dryrun: DryRun) -> jobstore.JobRecord:
        """Submit the entry's function through submitit's executor, its files (the batch script
        submitit writes, the pickled call, the logs and the result) in the record directory. A
        refusal leaves no directory behind."""
        import submitit

        request = slurm_function_request(dryrun.spec, dryrun.entry)
        directory = jobstore.jobs_root() / dryrun.job_id
        directory.mkdir(parents=True)
        (directory / "run").mkdir()
        (directory / (dryrun.artifact_name or "submitit.json")).write_text(dryrun.artifact or "")
        executor = submitit.SlurmExecutor(folder=directory, python=self.python)
        executor.update_parameters(**request.parameters, setup=request.setup)
        call = ModuleFunction(request.module, request.function)
        try:
            job = executor.submit(call, *request.args)
        except (subprocess.CalledProcessError, OSError, RuntimeError) as exc:
            _remove_tree(directory)
            raise SlurmError(_sbatch_message(str(getattr(exc, "stderr", None) or exc))) from None
        paths = job.paths
        record = jobstore.JobRecord(
            id=directory.name,
            name=dryrun.spec.name,
            target="slurm",
            created=time.time(),
            backend_id=str(job.job_id),
            command=dryrun.command,
            artifact=dryrun.artifact_name,
            extra={
                "log": str(paths.stdout),
                "run_dir": str(directory / "run"),
                "spec": dryrun.spec.model_dump(mode="json"),
                "submitit": {"folder": str(directory), "entry": dryrun.entry.name},
            },
        )
        jobstore.save(record)
        return record

    def result(self, record: jobstore.JobRecord) -> Any:
        """A function job's return value, read from submitit's result file; for any other job,
        the result line of its log."""
        found = record.extra.get("submitit")
        if found is None:
            return super().result(record)
        import submitit

        job: submitit.SlurmJob[Any] = submitit.SlurmJob(found["folder"], record.backend_id)
        if not job.paths.result_pickle.exists():
            raise ValueError(f"submitit wrote no result ({job.paths.result_pickle} is missing)")
        try:
            return job.result()
        except submitit.core.utils.UncompletedJobError as exc:
            # A failed function: submitit's error holds its traceback; the last line says why.
            raise ValueError(f"the function failed: {str(exc).strip().splitlines()[-1]}") from None

    # -- a sweep's job arrays --------------------------------------------------------------------
    def sweep_groups(self, specs: list[JobSpec]) -> list[list[int]]:
        """Specs whose scripts differ only by spec and name go as one job array."""
        groups: dict[tuple, list[int]] = {}
        for index, spec in enumerate(specs):
            groups.setdefault(array_key(spec), []).append(index)
        return list(groups.values())

    def sweep_dryrun(self, sweep_id: str, name: str, specs: list[JobSpec]) -> DryRun:
        """One job array for specs that share resources and environment: task i runs
        specs[i]."""
        return self._script_dryrun(name, specs[0], specs)

    def schedule_sweep(self, dryrun: DryRun, specs: list[JobSpec]) -> SweepJobs:
        """Submit the array (sbatch's refusal ends the sweep: SlurmError); one record per
        task."""
        records = self.schedule_array(dryrun, specs)
        return SweepJobs(
            [record.id for record in records],
            note=f"submitted job array {records[0].extra['array']} "
            f"({len(records)} tasks: "
            f"{', '.join(spec.name for spec in specs)})",
        )

    def schedule_array(self, dryrun: DryRun, specs: list[JobSpec]) -> list[jobstore.JobRecord]:
        """Submit the array; returns one record per task (ids <array>_<i>), so status, logs,
        cancel and wait work on each task."""
        directory, array_id = self._submit(dryrun)
        array_name = Path(dryrun.artifact_name or "array.sbatch").stem
        records = []
        for index, spec in enumerate(specs):
            task = f"{array_id}_{index}"
            record = jobstore.JobRecord(
                id=f"{directory.name}-{index}",
                name=spec.name,
                target="slurm",
                created=time.time(),
                backend_id=task,
                command=dryrun.command,
                artifact=str(directory / (dryrun.artifact_name or "array.sbatch")),
                extra={
                    "log": str(directory / f"{array_name}-{task}.out"),
                    "run_dir": str(directory / "run" / str(index)),
                    "spec": spec.model_dump(mode="json"),
                    "array": array_id,
                },
            )
            jobstore.save(record)
            records.append(record)
        return records

    # -- an existing job ------------------------------------------------------------------------
    def status(self, record: jobstore.JobRecord) -> Status:
        """Slurm's state, with the story of a requeued job told from its events."""
        status = query_status(record.backend_id)
        max_restarts = (
            record.extra.get("spec", {}).get("cluster", {}).get("slurm", {}).get("max_restarts", 0)
        )
        return tell_story(
            status,
            events.read_events(record.extra["run_dir"]),
            run_states(record.backend_id),
            max_restarts,
        )

    def read_log(self, record: jobstore.JobRecord, rank: int | None = None) -> list[str]:
        """The job's output file (every rank's lines labelled by srun), or one rank's."""
        path = log_path(record)
        if not path.exists():
            return []
        return rank_lines(path.read_text(errors="replace").splitlines(keepends=True), rank)

    def follow_log(self, record: jobstore.JobRecord, rank: int | None = None) -> Iterator[str]:
        """The output file's lines as they are written, until the job is over."""
        return follow(log_path(record), record.backend_id, rank)

    def cancel(self, record: jobstore.JobRecord) -> None:
        """scancel the job."""
        cancel(record.backend_id)

    def explain(self, record: jobstore.JobRecord, status: Status) -> list[str]:
        """What a user needs next to a failed state: the failing rank's last lines, or the OOM
        with the layout that caused it."""
        lines = self.read_log(record)
        if status.state == "OOM":
            layout = describe_layout(record.extra.get("spec", {}))
            oom = [
                line.split("error: ", 1)[1].rstrip()
                for line in lines
                if "error: out of memory" in line
            ]
            return [f"out of device memory with {layout}"] + oom[:1]
        if status.state in ("FAILED", "BAD_INPUT"):
            ranks = failing_ranks(lines)
            if not ranks:
                return [line.rstrip() for line in lines[-15:]]
            own = rank_lines(lines, ranks[0])
            # Its error line first: a traceback can push it out of the last lines.
            error = next(
                (line.split("] error: ", 1)[1].rstrip() for line in own if "] error: " in line), ""
            )
            out = [f"rank {ranks[0]} error: {error}"] if error else []
            out.append(f"rank {ranks[0]} failed; its last lines:")
            return out + [line.rstrip() for line in own[-15:]]
        return []


def _sbatch_message(text: str) -> str:
    # Keep Slurm's own words, each once (sbatch can repeat a line).
    found = re.findall(r"sbatch: error: ([^\n]+)", text)
    return "sbatch refused the job: " + ("; ".join(dict.fromkeys(found)) if found else text.strip())


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# logs
# --------------------------------------------------------------------------------------------
_LABEL = re.compile(r"^\s*(\d+): ?")


def log_path(record: jobstore.JobRecord) -> Path:
    return Path(record.extra["log"])


def rank_lines(lines: list[str], rank: int | None) -> list[str]:
    """srun --label prefixes each task's lines with its rank; keep one rank's, unprefixed."""
    if rank is None:
        return lines
    out = []
    for line in lines:
        match = _LABEL.match(line)
        if match and int(match.group(1)) == rank:
            out.append(line[match.end() :])
    return out


def failing_ranks(lines: list[str]) -> list[int]:
    ranks: list[int] = []
    for line in lines:
        match = _LABEL.match(line)
        if match and "] error:" in line and int(match.group(1)) not in ranks:
            ranks.append(int(match.group(1)))
    return ranks


def follow(path: Path, job_id: str, rank: int | None, poll_seconds: float = 0.5) -> Iterator[str]:
    """Yield the log's lines as they are written, until the job is over."""
    position = 0
    while True:
        done = query_status(job_id).terminal
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as handle:
                handle.seek(position)
                chunk = handle.read()
                position = handle.tell()
            complete = chunk.splitlines(keepends=True)
            if complete and not complete[-1].endswith("\n") and not done:
                position -= len(complete.pop())  # a half-written line: next round
            yield from rank_lines(complete, rank)
        if done:
            return
        time.sleep(poll_seconds)


def cancel(job_id: str) -> None:
    result = _run(["scancel", job_id])
    if result.returncode != 0:
        raise SlurmError(result.stderr.strip() or f"scancel {job_id} failed")
