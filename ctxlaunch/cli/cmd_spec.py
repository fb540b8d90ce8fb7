"""`validate` and `schema`: the job spec itself."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from ctxlaunch.cli.common import SetOpt, SpecArg, err, load, out, print_warnings
from ctxlaunch.contract import exitcodes


def validate(
    spec: SpecArg,
    set_: SetOpt = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Machine-readable output: the layout and warnings, or every problem (exit 2).",
        ),
    ] = False,
) -> None:
    """Check a spec: every problem with its field path, the value, the rule and a fix."""
    if as_json:
        _validate_json(spec, set_)
        return
    job = load(spec, set_)
    print_warnings(job)
    c, p = job.cluster, job.parallel
    out.print(
        f"ok: {job.name}: {c.nodes} x {c.gpus_per_node} {c.gpu} "
        f"(tp {p.tp}, pp {p.pp}, cp {p.cp} {p.cp_algorithm}, ep {p.ep}, dp {job.parallel_dims.dp}), "
        f"target {c.target}"
    )


def _validate_json(spec: SpecArg, overrides: list[str] | None) -> None:
    """`validate --json`: {"ok": true, the layout, the warnings}, or {"ok": false, every
    problem with its field path} and exit 2 (the problems in words on stderr too)."""
    from ctxlaunch.contract.loader import SpecError, apply_overrides, read_spec_data, validate_spec

    try:
        job = validate_spec(apply_overrides(read_spec_data(spec), overrides or ()), str(spec))
    except SpecError as exc:
        err.print(str(exc), markup=False)
        problems = [{"path": p.path, "message": p.message} for p in exc.problems]
        out.print_json(json.dumps({"ok": False, "spec": str(spec), "problems": problems}))
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    c, p = job.cluster, job.parallel
    layout = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "cp_algorithm": p.cp_algorithm, "ep": p.ep}
    report = {
        "ok": True,
        "spec": str(spec),
        "name": job.name,
        "target": c.target,
        "nodes": c.nodes,
        "gpus_per_node": c.gpus_per_node,
        "gpu": c.gpu,
        "parallel": {**layout, "dp": job.parallel_dims.dp},
        "warnings": list(job.warnings()),
    }
    out.print_json(json.dumps(report))


def schema(
    markdown: Annotated[
        bool,
        typer.Option(
            "--markdown",
            help="Print the spec's reference page instead (Markdown: every field with its type, "
            "constraints, default and description; docs/reference/spec.md is this output).",
        ),
    ] = False,
) -> None:
    """Print the job spec's JSON Schema (for editor completion and validation), or with
    --markdown the reference page written from it."""
    from ctxlaunch.contract.spec import json_schema

    if markdown:
        from ctxlaunch.cli.spec_reference import spec_reference

        sys.stdout.write(spec_reference(json_schema()))
        return
    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
