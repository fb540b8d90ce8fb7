"""`python -m ctxlaunch.runtime.evaluation.eval_main SPEC --out RESULT`: one rank of `ctxlaunch eval`
(torchrun starts it). It loads the newest checkpoint (or --checkpoint; or, with --base or none
committed, the model.init_from weights as imported) at the spec's layout,
evaluates (ctxlaunch.runtime.evaluation.evaluator), and rank 0 writes the result as JSON to --out.
Exit statuses: 0 done, 2 bad spec, checkpoint or set-up, 1 anything else."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError
from ctxlaunch.runtime import tether
from ctxlaunch.runtime.parallel.rank_setup import (
    SetupError,
    check_world_size,
    join_process_group,
    load_job_spec,
    rank_context,
)

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.parallel.distenv import DistEnv
    from ctxlaunch.runtime.records import EvalResult


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ctxlaunch.runtime.evaluation.eval_main",
        description="One rank of `ctxlaunch eval`.",
    )
    parser.add_argument("spec", nargs="?", help="job spec; default: $CTXLAUNCH_SPEC_JSON")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    parser.add_argument("--checkpoint", help="the checkpoint step directory to load")
    parser.add_argument("--base", action="store_true", help="evaluate model.init_from as imported")
    parser.add_argument("--out", required=True, help="where rank 0 writes the result (JSON)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from ctxlaunch.runtime.evaluation.eval_weights import checkpoint_to_load
    from ctxlaunch.runtime.parallel import distenv

    tether.hold_to_launcher()  # a rank never outlives the `ctxlaunch eval` that started it
    args = parse_args(argv)
    try:
        spec = load_job_spec(args)
        path = checkpoint_to_load(spec, args.checkpoint, args.base)
        denv = distenv.detect()
        check_world_size(spec, denv)
    except (SpecError, SetupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exitcodes.BAD_INPUT
    try:
        result = _evaluate(spec, denv, path)
    except ValueError as exc:
        print(f"[rank {denv.rank}] error: {exc}", file=sys.stderr, flush=True)
        return exitcodes.BAD_INPUT
    if denv.rank == 0:
        out = Path(args.out)
        with tempfile.NamedTemporaryFile(
            "w", dir=out.parent, delete=False, suffix=".tmp"
        ) as handle:
            weights = {"checkpoint": str(path) if path else None}
            if path is None:
                weights["init_from"] = spec.model.init_from
            json.dump({**weights, **result.to_dict()}, handle, indent=2)
        os.replace(handle.name, out)
    return exitcodes.OK


def _evaluate(spec: JobSpec, denv: DistEnv, path: Path | None) -> EvalResult:
    """Join the job's group, build this rank's part of the model (forward only: whole weights,
    no DeepSpeed; model.init_from's weights when it is set), load the checkpoint at `path`
    into it (None: keep the imported weights) and evaluate."""

    import torch
    import torch.distributed as dist

    from ctxlaunch.runtime.evaluation.eval_weights import load_weights
    from ctxlaunch.runtime.evaluation.evaluator import Evaluator
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.parallel.parallelize import parallelize_job

    device = join_process_group(spec, denv)
    try:
        ctx = rank_context(spec, denv)
        with torch.device("meta"):
            model = Transformer.from_spec(spec.model)
        # Forward only: under DeepSpeed the weights stay whole (parallelize shards for FSDP2).
        parts = parallelize_job(model, spec, ctx=ctx, device=device)
        if path is not None:
            load_weights(parts, spec, ctx, device, path)
        evaluator = Evaluator(spec, ctx, parts.model, device)
        result = evaluator.run()
    finally:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.exit(main())
