"""`train`: one rank of the bundled trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ctxlaunch.cli.common import SetOpt


def train(
    spec: Annotated[
        Path | None,
        typer.Argument(help="Job spec; default: $CTXLAUNCH_SPEC_JSON.", show_default=False),
    ] = None,
    set_: SetOpt = None,
    run_dir: Annotated[
        str | None, typer.Option("--run-dir", help="Where metrics.jsonl and summary.json go.")
    ] = None,
) -> None:
    """Run one rank of the bundled trainer (what torchrun, srun or a PyTorchJob pod starts)."""
    from ctxlaunch.runtime.trainer.main import main as trainer_main

    argv = [str(spec)] if spec else []
    for item in set_ or ():
        argv += ["--set", item]
    if run_dir:
        argv += ["--run-dir", run_dir]
    raise typer.Exit(trainer_main(argv))
