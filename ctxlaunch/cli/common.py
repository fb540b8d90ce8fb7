"""What the commands share: the consoles, the spec and job arguments, loading a spec, and
failing with the right exit status."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError, apply_overrides, read_spec_data, validate_spec

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec

out = Console(highlight=False, soft_wrap=True)
if not out.is_terminal:
    out.width = 160  # tables piped to a file or a program should not wrap at 80 columns
err = Console(stderr=True, highlight=False, soft_wrap=True)

SpecArg = Annotated[Path, typer.Argument(help="Job spec (YAML).", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="Override a field: path.to.field=value (YAML value). Repeatable."
    ),
]


def fail(message: str, code: int = exitcodes.BAD_INPUT) -> NoReturn:
    """Print the error and exit with `code` (default 2: bad input, nothing done)."""
    # The message is text: brackets in it (a field path's [0], an extra's [train]) are not markup.
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    raise typer.Exit(code)


def load(spec: Path, overrides: list[str] | None, **forced: object) -> JobSpec:
    """Read and validate a spec, or exit 2 listing every problem. `forced` sets fields the
    command itself decides (e.g. render --target sets cluster.target)."""
    try:
        data = apply_overrides(read_spec_data(spec), overrides or ())
        if forced:
            data = apply_overrides(data, [f"{k}={json.dumps(v)}" for k, v in forced.items()])
        job = validate_spec(data, str(spec))
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    if job.cluster.profile is not None:
        from ctxlaunch.perf.machine import load_profile

        try:  # its constants, each of its type, before anything computes with them
            load_profile(Path(job.cluster.profile))
        except ValueError as exc:
            fail(str(exc))
    return job


def print_warnings(spec: JobSpec) -> None:
    """The spec's warnings, on stderr."""
    for warning in spec.warnings():
        err.print(f"[yellow]warning:[/] {warning}", markup=True)


JobArg = Annotated[
    str, typer.Argument(help="ctxlaunch job id or the scheduler's job id.", show_default=False)
]
