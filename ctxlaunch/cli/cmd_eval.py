"""`eval`: the held-out loss per context length and the passkey probe of a checkpoint, at the
spec's own layout, on this machine (torchrun, one process per rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ctxlaunch.cli.common import SetOpt, SpecArg, err, fail, load, out
from ctxlaunch.cli.extras import require
from ctxlaunch.contract import exitcodes, lifeline
from ctxlaunch.contract.rundir import EVAL_MODULE, SPEC_ENV, cpu_threads_per_rank, spec_json


def evaluate(
    spec: SpecArg,
    set_: SetOpt = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            help="A checkpoint step directory; default: the newest in training.checkpoint.dir.",
        ),
    ] = None,
    base: Annotated[
        bool,
        typer.Option(
            "--base",
            help="Evaluate model.init_from as imported (the baseline before training), even "
            "where checkpoints exist.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Evaluate a checkpoint on held-out data: loss and perplexity per context-length bucket,
    and passkey retrieval per length and depth (training.eval), forward only at the spec's
    layout (pp 1; checkpoints load at any layout, so --set parallel.pp=1 evaluates a pipeline
    job's). Without a committed checkpoint (or with --base), a model.init_from checkpoint is
    evaluated as imported: the base model's scores, to compare with after training."""
    require("eval", "torch")  # the ranks run under torchrun, in processes of this Python
    job = load(spec, set_)
    if job.parallel.pp > 1:
        fail(
            f"parallel.pp = {job.parallel.pp}: evaluation runs forward only without a pipeline "
            "schedule; --set parallel.pp=1 (the checkpoint loads at any layout)"
        )
    if job.cluster.nodes != 1:
        fail(
            f"cluster.nodes = {job.cluster.nodes}: `ctxlaunch eval` runs on this machine; "
            "--set cluster.nodes=1 with the GPUs of one node"
        )
    if base and job.model.init_from is None:
        fail("--base evaluates model.init_from as imported, and it is not set")
    if base and checkpoint:
        fail("--base evaluates model.init_from as imported: drop --checkpoint")
    ranks = job.cluster.gpus_per_node
    with tempfile.TemporaryDirectory(prefix="ctxlaunch-eval-") as scratch:
        result_path = Path(scratch) / "result.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={ranks}",
            "--role=rank",
            f"--log-dir={scratch}/logs",
            "--tee=3",
            "--local-ranks-filter=0",
            "-m",
            EVAL_MODULE,
            "--out",
            str(result_path),
        ]
        if checkpoint:
            command += ["--checkpoint", checkpoint]
        if base:
            command.append("--base")
        env = {**os.environ, SPEC_ENV: spec_json(job), **lifeline.launcher_env()}
        if job.cluster.gpu == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(ranks)))
        process = subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            # torchrun dies with this command, and each rank with torchrun (runtime.tether).
            preexec_fn=lifeline.child_of(os.getpid()),
        )
        if process.returncode or not result_path.is_file():
            errors = _rank_errors(Path(scratch) / "logs") or process.stderr.strip().splitlines()
            detail = "\n".join(errors[-12:])
            if "error:" in detail and "Traceback" not in detail:
                # Bad input every rank found alike (a checkpoint of another model): said once.
                said = [line.split("error:", 1)[1].strip() for line in errors if "error:" in line]
                fail("evaluation refused: " + "\n".join(dict.fromkeys(said)), exitcodes.BAD_INPUT)
            fail(f"evaluation failed (exit {process.returncode}):\n{detail}", exitcodes.FAILED)
        result = json.loads(result_path.read_text())
    if as_json:
        out.print(json.dumps(result, indent=2), markup=False)
        return
    from ctxlaunch.runtime.records import EvalResult

    shown = EvalResult.from_dict(result)
    weights = result["checkpoint"] or f"model.init_from {result['init_from']} as imported"
    err.print(f"ctxlaunch: evaluated {weights}", markup=False)
    for line in shown.lines():
        out.print(line, markup=False)


def _rank_errors(logs: Path) -> list[str]:
    """The lines of every rank's stderr that say what went wrong."""
    lines: list[str] = []
    for path in sorted(logs.glob("*/attempt_*/*/stderr.log")):
        lines += [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines
