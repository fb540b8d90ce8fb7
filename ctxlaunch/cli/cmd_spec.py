"""`validate` and `schema`: the job spec itself."""

from __future__ import annotations

import json
import sys

from ctxlaunch.cli.common import SetOpt, SpecArg, load, out, print_warnings


def validate(spec: SpecArg, set_: SetOpt = None) -> None:
    """Check a spec: every problem with its field path, the value, the rule and a fix."""
    job = load(spec, set_)
    print_warnings(job)
    c, p = job.cluster, job.parallel
    out.print(
        f"ok: {job.name}: {c.nodes} x {c.gpus_per_node} {c.gpu} "
        f"(tp {p.tp}, pp {p.pp}, cp {p.cp} {p.cp_algorithm}, ep {p.ep}, dp {job.dp}), "
        f"target {c.target}"
    )


def schema() -> None:
    """Print the job spec's JSON Schema (for editor completion and validation)."""
    from ctxlaunch.contract.spec import json_schema

    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
