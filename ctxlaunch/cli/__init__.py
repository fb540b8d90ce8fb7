"""The `ctxlaunch` command: validate, plan, render, schema, submit, ...

Exit statuses: 0 success, 2 bad input (nothing written, nothing started), 1 a failed job or
backend error; see ctxlaunch.contract.exitcodes.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from ctxlaunch import __version__
from ctxlaunch.cli import (
    cmd_data,
    cmd_eval,
    cmd_export,
    cmd_image,
    cmd_init,
    cmd_jobs,
    cmd_plan,
    cmd_share,
    cmd_spec,
    cmd_sweeps,
    cmd_train,
)
from ctxlaunch.cli.common import out
from ctxlaunch.cli.extras import needs_extras

app = typer.Typer(
    name="ctxlaunch",
    help="Plan, render, submit and run long-context (context-parallel) training jobs.",
    no_args_is_help=True,
    # --install-completion / --show-completion: bash, zsh, fish and PowerShell complete the
    # commands, their options and the spec paths.
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    """--version: eager, so it answers before click asks for a command (a group callback runs
    only once a command is given: `ctxlaunch --version` alone would be "Missing command")."""
    if value:
        out.print(f"ctxlaunch {__version__}", markup=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version and exit.",
            callback=_print_version,
            is_eager=True,
            expose_value=False,
        ),
    ] = False,
) -> None:
    """Options before any command."""


# Registered in this order: `ctxlaunch --help` lists the commands so.
COMMANDS: list[tuple[str | None, Callable[..., None]]] = [
    (None, cmd_init.init),
    (None, cmd_spec.validate),
    (None, cmd_plan.plan),
    (None, cmd_plan.advise),
    (None, cmd_plan.calibrate),
    (None, cmd_jobs.render),
    (None, cmd_jobs.submit),
    (None, cmd_jobs.status),
    (None, cmd_jobs.logs),
    (None, cmd_jobs.cancel),
    (None, cmd_jobs.wait),
    ("list", cmd_jobs.list_jobs),
    (None, cmd_sweeps.sweep),
    (None, cmd_sweeps.report),
    (None, cmd_train.train),
    ("eval", cmd_eval.evaluate),
    (None, cmd_export.export),
    (None, cmd_spec.schema),
    (None, cmd_share.examples),
    (None, cmd_share.dashboard),
    (None, cmd_share.alerts),
]
"""(name when it is not the function's, the command)."""
for command_name, command in COMMANDS:
    # A package of an extra found missing ends the command with the extra to install.
    typed = command_name or command.__name__.replace("_", "-")  # typer's name for it
    app.command(name=command_name)(needs_extras(typed)(command))
app.add_typer(cmd_data.data, name="data")
app.add_typer(cmd_image.image, name="image")


def main() -> None:
    """The console script `ctxlaunch`."""
    # `submit --dry-run=server` (kubectl's spelling): the option parser has no optional-value
    # flags, so that one spelling is read as the hidden --dry-run-server.
    sys.argv = [
        "--dry-run-server"
        if arg == "--dry-run=server"
        else "--dry-run"
        if arg == "--dry-run=client"
        else arg
        for arg in sys.argv
    ]
    try:
        app()
    finally:
        # The command is done: spare the interpreter's exit the garbage collector's passes
        # over every module's objects (a noticeable share of a short command such as `submit`).
        # Exit handlers, flushes and finalisers still run as objects are released.
        gc.freeze()


if __name__ == "__main__":
    main()
