"""`init`: a first spec from a Hugging Face model, a sequence length and the cluster found."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ctxlaunch.cli.common import err, fail, out
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError


def init(
    model: Annotated[
        str,
        typer.Argument(
            help="A Hugging Face model directory (holding config.json), or a hub id ORG/NAME "
            "(only its config.json is read, where the hub answers).",
            show_default=False,
        ),
    ],
    seq_len: Annotated[
        int, typer.Option("--seq-len", help="Tokens per sequence to train at.", min=1)
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Write the spec to this file (atomically); default: stdout."
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="The job's name (default: from the model's).")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="local, slurm or kubernetes; default: the first that answers with GPUs "
            "(sinfo, kubectl get nodes), else this machine.",
        ),
    ] = None,
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="The GPU type, where the tools do not say it.")
    ] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes to use.", min=1)] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option("--gpus-per-node", help="GPUs per node.", min=1)
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="With --output: overwrite a file that exists.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Machine-readable output: the spec's text, the cluster found."),
    ] = False,
) -> None:
    """Write a commented job spec that validates, from a Hugging Face model, a sequence length
    and the cluster in front of you (Slurm's partitions and GPUs, Kubernetes nodes' GPUs, or
    this machine), with the layout `advise` ranks first."""
    from ctxlaunch import api
    from ctxlaunch.contract.fsutil import atomic_write_text

    if output is not None and output.exists() and not force:
        fail(f"--output: {output} exists; pass --force to overwrite it (nothing written)")
    try:
        started = api.init_spec(
            model,
            seq_len,
            name=name,
            target=target,
            gpu=gpu,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
        )
    except api.ApiError as exc:
        fail(str(exc))
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    if output is not None:
        atomic_write_text(output, started.text)
        err.print(f"wrote {output}: {started.cluster.source}", markup=False)
    if as_json:
        out.print_json(json.dumps({**started.to_dict(), "path": str(output) if output else None}))
    elif output is None:
        sys.stdout.write(started.text)
