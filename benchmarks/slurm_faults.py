"""The figures of RELIABILITY.md, read back from a run of tests/service/slurm_prometheus/test_slurm_faults.py.

    pytest tests/service/slurm_prometheus/test_slurm_faults.py --basetemp=/var/tmp/slurm-faults
    python benchmarks/slurm_faults.py /var/tmp/slurm-faults

For every job the tests submitted: Slurm's record of each run (sacct --duplicates: state,
start, end), the last step each run logged, the step the next run resumed from (steps lost =
the difference), the gap between a run's end and the next run's start (time to resume, with
the fault's own detection time where Slurm had to notice it), and the final status in words."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path


def runs(job_id: str) -> list[tuple[str, datetime.datetime, datetime.datetime | None]]:
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-D", "-n", "-P", "-o", "State,Start,End"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    parsed = []
    for line in out.splitlines():
        state, start, end = line.split("|")
        parsed.append(
            (
                state.split()[0],
                datetime.datetime.fromisoformat(start),
                None if end == "Unknown" else datetime.datetime.fromisoformat(end),
            )
        )
    return parsed


def main(base: Path) -> None:
    for record in sorted(base.glob("*/**/jobs/*/job.json")):
        job = json.loads(record.read_text())
        log_path = Path(job["extra"]["log"])
        if not log_path.exists():
            continue
        log = log_path.read_text(errors="replace")
        pieces = re.split(r"^ctxlaunch: job \S+ restart \d+ on .*$", log, flags=re.M)[1:]
        last = [max(map(int, re.findall(r"^0: step (\d+)/", p, re.M)), default=0) for p in pieces]
        resumed = [int(s) for s in re.findall(r"resumed from \S*step-(\d+)", log)]
        history = runs(job["backend_id"])
        test = record.relative_to(base).parts[0]
        if test.endswith("current"):  # pytest's link to the newest directory
            continue
        status = subprocess.run(
            [str(Path(sys.executable).parent / "ctxlaunch"), "status", job["backend_id"]],
            capture_output=True,
            text=True,
            env={**os.environ, "CTXLAUNCH_HOME": str(record.parents[2])},
        )
        print(f"{test} job {job['backend_id']}:", " / ".join(status.stdout.strip().splitlines()))
        for index, (state, start, end) in enumerate(history):
            line = (
                f"  run {index + 1}: {state:10} {start:%H:%M:%S}-{end:%H:%M:%S}"
                if end
                else f"  run {index + 1}: {state:10} {start:%H:%M:%S}-"
            )
            if index < len(last):
                line += f"  last step logged {last[index]}"
            if index < len(resumed):
                line += (
                    f", next run resumed from {resumed[index]} "
                    f"(steps lost {last[index] - resumed[index]})"
                )
            if end and index + 1 < len(history):
                line += f", next run started {(history[index + 1][1] - end).total_seconds():.0f} s later"
            print(line)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
