"""`ctxlaunch submit` against plain `sbatch` of the same script on the same Slurm cluster.

    .venv/bin/python benchmarks/slurm_submit.py [--reps 5] [--steps 2]

Needs the test cluster (scripts/services/slurm.sh start). Renders the demo spec for Slurm once;
then, alternating, submits it with `ctxlaunch submit` and submits the rendered script with plain
`sbatch`, and for each measures from the moment the command is started: the command's own
time, the time until Slurm reports the job RUNNING, and the time until it is COMPLETED. Both
jobs run the same trainer for the same steps, so the difference is what ctxlaunch adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SETS = [
    "cluster.target=slurm",
    "cluster.slurm.exclusive=false",
    "training.seq_len=512",
    "training.checkpoint.dir=null",
    "cluster.slurm.time_limit=10:00",
]


def job_state(job_id: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True
    ).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def measure(command: list[str], cwd: Path, env: dict[str, str], parse_id) -> dict[str, float]:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    submitted = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {result.stderr}")
    job_id = parse_id(result.stdout)
    running = None
    while True:
        state = job_state(job_id)
        now = time.perf_counter() - start
        if running is None and state in ("RUNNING", "COMPLETING", "COMPLETED"):
            running = now
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            if state != "COMPLETED":
                raise RuntimeError(f"job {job_id} ended {state}")
            return {"submit": submitted, "running": running or now, "completed": now}
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    sets = SETS + [f"training.steps={args.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {
            **os.environ,
            "CTXLAUNCH_HOME": str(work / "home"),
            "PATH": f"{BIN}:{os.environ['PATH']}",
        }
        render = [
            str(BIN / "ctxlaunch"),
            "render",
            str(ROOT / "jobs/demo.yaml"),
            "-t",
            "slurm",
            "-o",
            str(work),
        ]
        submit = [str(BIN / "ctxlaunch"), "submit", str(ROOT / "jobs/demo.yaml")]
        for item in sets:
            render += ["--set", item]
            submit += ["--set", item]
        subprocess.run(render, check=True, env=env, capture_output=True)
        sbatch = ["sbatch", "--parsable", str(work / "demo.sbatch")]
        results: dict[str, list[dict[str, float]]] = {"ctxlaunch submit": [], "plain sbatch": []}
        for _ in range(args.reps):
            results["ctxlaunch submit"].append(
                measure(submit, work, env, lambda out: out.strip().splitlines()[-1])
            )
            results["plain sbatch"].append(
                measure(sbatch, work, env, lambda out: out.strip().split(";")[0])
            )
    print(
        f"median of {args.reps}, seconds from starting the command "
        f"(demo spec, {args.steps} steps, seq_len 512, CP 2 on one node)"
    )
    print("| | command returns | job RUNNING | job COMPLETED |")
    print("|---|---|---|---|")
    medians = {}
    for name, runs in results.items():
        medians[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = medians[name]
        print(f"| {name} | {m['submit']:.3f} | {m['running']:.3f} | {m['completed']:.3f} |")
    ours, plain = medians["ctxlaunch submit"], medians["plain sbatch"]
    print(
        f"| ratio | {ours['submit'] / plain['submit']:.2f}x | "
        f"{ours['running'] / plain['running']:.2f}x | "
        f"{ours['completed'] / plain['completed']:.2f}x |"
    )


if __name__ == "__main__":
    main()
