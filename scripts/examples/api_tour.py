"""A tour of ctxlaunch's Python API: load a spec with overrides, plan the whole run, rank its
layouts by cost over two GPU counts, render the batch script, see what a submission would send,
and check a broken spec without an exception. Nothing is submitted.

    python scripts/examples/api_tour.py [SPEC]

The calls never print or exit: what is printed here is this script's choice.
"""

from __future__ import annotations

import sys

from ctxlaunch import api


def main(spec_path: str = "jobs/llama3-8b-128k-slurm.yaml") -> None:
    # A spec file with two fields changed: a token budget and a price per GPU-hour.
    job = api.load_spec(spec_path, ["training.tokens=2000000000", "cluster.gpu_hour_price=2.5"])

    # The plan: fit, the predicted step, and the whole run with the step's expected error.
    plan = api.plan(job)
    print(plan.verdict())
    if plan.accounting is not None:
        print("the run:", plan.accounting.summary())

    # Every layout that fits on 16 or 32 GPUs, the cheapest run first.
    advice = api.advise(job, gpus=[16, 32], rank_by="cost")
    for candidate in advice.ranked[:3]:
        run = candidate.accounting
        cost = run.cost.value if run is not None and run.cost is not None else float("nan")
        print(f"{candidate.gpus:>3} GPUs  {candidate.describe()}  cost {cost:,.0f}")

    # The batch script, as text; and the exact command a submission would run.
    rendered = api.render(job)
    print(f"{rendered.main}: {len(rendered.text.splitlines())} lines")
    planned = api.submit(job, dry_run=True)
    print(" ".join(planned.dry_run.command))

    # A spec with problems: every one of them, as data.
    checked = api.validate(
        {"name": "Bad_Name", "model": {"preset": "llama3-8b"}, "training": {"seq_len": 0}}
    )
    for problem in checked.problems:
        print(f"problem: {problem.path}: {problem.message}")


if __name__ == "__main__":
    main(*sys.argv[1:])
