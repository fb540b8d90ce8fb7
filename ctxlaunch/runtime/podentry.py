"""`python3 -m ctxlaunch.runtime.podentry SPEC`: the container command of every PyTorchJob pod.

It runs torchrun (which takes the node count, node rank, ranks per node and master address
from the PET_* variables the training operator sets) on the bundled trainer, passes stop
signals on (pod eviction and node drain send SIGTERM: every rank checkpoints and exits
PREEMPTED), then exits with a status the operator's restartPolicy ExitCode reads right:
torchrun itself reports 1 for any failure, so the ranks' own statuses (written to
<run dir>/exit/rank-<r>) decide, through exitcodes.pod_exit_status: a checkpointed stop
restarts the pod, a bad spec, an OOM or a failure ends the job. A rank that the container's
memory cgroup killed (it leaves no status; the cgroup's oom_kill count rose) counts as an OOM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.heal_log import HEALING_KEY
from ctxlaunch.contract.rundir import (
    EXIT_DIR,
    RESULT_LINE,
    RUN_DIR_ENV,
    TRAINER_MODULE,
    combine_exit_codes,
    rank_exit_codes,
)

DEFAULT_RUN_DIR = "/tmp/ctxlaunch-run"
CGROUP_ROOT = Path("/sys/fs/cgroup")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def torchrun_command(spec_path: str, run_dir: Path) -> list[str]:
    # --role=rank --tee=3: every line of rank r is prefixed "[rank<r>]:", so `ctxlaunch logs
    # --rank` can pick one rank's lines out of a pod's log.
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--role=rank",
        "--tee=3",
        "-m",
        TRAINER_MODULE,
        spec_path,
        "--run-dir",
        str(run_dir),
    ]


def oom_kills(root: Path = CGROUP_ROOT) -> int:
    """How many processes the memory cgroup's OOM killer has killed in this container (cgroup
    v1 memory/memory.oom_control, v2 memory.events: their `oom_kill` line); 0 where neither
    can be read (not in a container, an older kernel)."""
    for path in (root / "memory" / "memory.oom_control", root / "memory.events"):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 -m ctxlaunch.runtime.podentry SPEC", file=sys.stderr)
        return exitcodes.BAD_INPUT
    run_dir = Path(os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR)
    # Statuses of an earlier attempt in this directory must not speak for this one.
    shutil.rmtree(run_dir / EXIT_DIR, ignore_errors=True)
    kills_before = oom_kills()
    process = subprocess.Popen(torchrun_command(args[0], run_dir))

    def forward(signum: int, _frame: object) -> None:
        process.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    returncode = process.wait()
    tell_healing(args[0])
    hand_back_summary(run_dir)
    if returncode == 0:
        return exitcodes.OK
    per_node = int(os.environ.get("PET_NPROC_PER_NODE") or 1)
    node_rank = int(os.environ.get("PET_NODE_RANK") or 0)
    codes = rank_exit_codes(run_dir, per_node, first=node_rank * per_node)
    statuses = ", ".join("killed" if c is None else str(c) for c in codes)
    killed = None in codes and oom_kills() > kills_before
    if killed:
        # A rank the memory cgroup killed leaves no status: its story is the OOM (not
        # retryable), not a failure.
        codes = [exitcodes.OOM if c is None else c for c in codes]
    status = combine_exit_codes(codes)
    exit_status = exitcodes.pod_exit_status(status)
    if status == exitcodes.OOM and heals_out_of_memory(args[0], run_dir, killed=killed):
        exit_status = exitcodes.POD_RETRY
    print(
        f"ctxlaunch: torchrun exited {returncode}; rank exit statuses "
        + statuses
        + f"; pod exits {exit_status}",
        file=sys.stderr,
        flush=True,
    )
    return exit_status


TERMINATION_LOG = Path("/dev/termination-log")
"""The container's termination message (terminationMessagePath's default): the kubelet copies
it into the pod's status, where `ctxlaunch status` reads it."""


def hand_back_summary(run_dir: Path) -> None:
    """The run's summary (rank 0's summary.json, measured beside predicted) as the pod's
    result line: the pod's files are not the submitter's, so `ctxlaunch status` reads it from
    the log (contract.rundir.RESULT_LINE). Nothing where this pod holds no summary."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    print(RESULT_LINE + json.dumps(summary, separators=(",", ":")), flush=True)


def tell_healing(spec_path: str, path: Path = TERMINATION_LOG) -> None:
    """Leave a healing job's re-plans so far (the heal log's, in words) as the container's
    termination message: `ctxlaunch status` tells them from the pod's status, since the pods
    of earlier runs, and their logs, are gone."""
    import json

    from ctxlaunch.contract.heal_log import read_heal_log, replan_stories
    from ctxlaunch.contract.loader import SpecError, load_spec

    try:
        spec = load_spec(spec_path)
    except SpecError:
        return
    if not spec.training.heal.enabled:
        return
    stories = replan_stories(read_heal_log(spec.training.checkpoint.dir))
    if not stories or not path.exists():  # the kubelet makes the file; elsewhere there is none
        return
    try:
        # The kubelet keeps at most 4096 bytes of the message: the newest re-plans first.
        text = json.dumps({HEALING_KEY: stories})
        while len(text.encode()) > 4000 and len(stories) > 1:
            stories = stories[1:]
            text = json.dumps({HEALING_KEY: stories})
        path.write_text(text)
    except OSError:
        pass


def heals_out_of_memory(spec_path: str, run_dir: Path, killed: bool) -> bool:
    """Whether this pod's out-of-memory restarts the job to re-plan (training.heal on_oom
    replan, re-plans left): then the pod exits retryable (POD_RETRY) and the operator replaces
    it. A rank the memory cgroup killed is recorded in the heal log here (the trainer recorded
    its own OutOfMemoryError)."""
    from ctxlaunch.contract import events
    from ctxlaunch.contract.heal_log import OomEntry, record_oom, restarts_for_oom
    from ctxlaunch.contract.loader import SpecError, load_spec

    try:
        spec = load_spec(spec_path)
    except SpecError:
        return False
    heal, directory = spec.training.heal, spec.training.checkpoint.dir
    if heal.on_oom != "replan" or directory is None:
        return False
    if killed:
        steps = [int(e.get("step")) for e in events.read_events(run_dir) if e.kind == events.STEP]
        message = "a rank was killed by the kernel's OOM killer at the pod's memory limit"
        step = steps[-1] + 1 if steps else None
        record_oom(directory, OomEntry(source="cgroup", phase="killed", step=step, message=message))
        events.append_event(
            run_dir, events.OOM, rank=-1, step=step, message=message, phase="killed", figures={}
        )
    if not restarts_for_oom(directory, heal.max_replans):
        return False
    print(
        "ctxlaunch: out of memory; training.heal re-plans the layout: the pod exits "
        f"{exitcodes.POD_RETRY} to be replaced, and the next one resumes from the newest "
        "checkpoint",
        file=sys.stderr,
        flush=True,
    )
    return True


if __name__ == "__main__":
    sys.exit(main())
