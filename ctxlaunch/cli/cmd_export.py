"""`export`: a trained checkpoint as a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ctxlaunch.cli.common import err, fail, out
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError, load_spec


def export(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A checkpoint step directory (step-NNNNNNNN), or training.checkpoint.dir for its "
            "newest committed step.",
            show_default=False,
        ),
    ],
    hf: Annotated[
        Path,
        typer.Option(
            "--hf", help="The Hugging Face directory to write (must not exist).", show_default=False
        ),
    ],
    spec: Annotated[
        Path | None,
        typer.Option(
            help="The job spec the checkpoint was trained with (default: the model the trainer "
            "stored with the checkpoint)."
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            help="auto (the init_from checkpoint's dtype, else fp32), fp32, bf16 or fp16."
        ),
    ] = "auto",
    shard_size_mib: Annotated[int, typer.Option(min=1, help="Largest safetensors shard, MiB.")] = 5
    * 1024,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="A tokenizer to ship with it (tokenizer.json, a SentencePiece model or a tiktoken "
            "file: written as tokenizer.json or tokenizer.model), beside the init_from "
            "checkpoint's own tokenizer files."
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Machine-readable output: the directory, the step, the files."),
    ] = False,
) -> None:
    """Write CHECKPOINT (any layout: torch.distributed.checkpoint or DeepSpeed) as a Hugging
    Face directory of the model's own family (its transformers class in config.json, with the
    RoPE it was trained with), safetensors shards and their index, the init_from checkpoint's
    tokenizer files. Written to a temporary
    directory and renamed into place; on an error nothing is left at --hf, nor any directory made
    for it."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ctxlaunch.runtime.checkpointing.hf import HFCheckpointError
    from ctxlaunch.runtime.checkpointing.hf import export as export_hf

    if dtype not in ("auto", "fp32", "bf16", "fp16"):
        fail(f"--dtype {dtype!r}: use auto, fp32, bf16 or fp16")
    model = None
    if spec is not None:
        try:
            model = load_spec(spec).model
        except SpecError as exc:
            err.print(str(exc), markup=False)
            raise typer.Exit(exitcodes.BAD_INPUT) from None
    if not checkpoint.is_dir():
        fail(f"{checkpoint} is not a directory")
    from ctxlaunch.contract.fsutil import sigterm_interrupts

    try:
        # SIGTERM unwinds as Ctrl-C does: the half-written directory is removed.
        with sigterm_interrupts():
            step, files = export_hf(
                checkpoint,
                hf,
                model=model,
                dtype=dtype,
                shard_bytes=shard_size_mib * 2**20,
                tokenizer=tokenizer,
                show_progress=True,
            )
    except KeyboardInterrupt:
        fail(f"export to {hf} interrupted; nothing was written", exitcodes.FAILED)
    except (HFCheckpointError, ValueError, OSError) as exc:
        fail(f"export of {checkpoint} failed: {exc}")
    except ModuleNotFoundError:
        raise  # a package of an extra (safetensors, a tokenizer's): the command names it
    except (Exception, CheckpointException) as exc:  # a damaged checkpoint: DCP's or DeepSpeed's
        fail(
            f"export of {checkpoint} failed reading it: {type(exc).__name__}: {exc}",
            exitcodes.FAILED,
        )
    if as_json:
        out.print_json(json.dumps({"hf": str(hf), "step": str(step), "files": list(files)}))
        return
    out.print(f"wrote {hf} from {step}: {', '.join(files)}")
