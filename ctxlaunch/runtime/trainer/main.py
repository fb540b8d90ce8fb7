"""`python -m ctxlaunch.runtime.trainer [SPEC]`: one rank of a job.

The spec comes from the SPEC path, else from $CTXLAUNCH_SPEC_JSON (what the Slurm script
exports). Rank and world come from torchrun, Slurm or the PyTorchJob environment.
Exit statuses: 0 done, 2 bad spec or set-up (before any work), 75 checkpointed after a stop
signal (requeue me), 86 out of memory, 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from ctxlaunch.contract import dirlock, events, exitcodes
from ctxlaunch.contract.dirlock import DirectoryInUse
from ctxlaunch.contract.loader import SpecError
from ctxlaunch.contract.rundir import (
    JOB_ID_ENV,
    RUN_DIR_ENV,
    SPEC_ENV,
    default_run_dir,
    write_exit_code,
)
from ctxlaunch.runtime.checkpointing.checkpoint import CheckpointDirError, check_writable
from ctxlaunch.runtime.checkpointing.safe_unpickle import (
    CheckpointDamaged,
    CheckpointOfAnotherModel,
    CheckpointRefused,
)
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ctxlaunch.runtime.trainer", description="Run one rank of a ctxlaunch job."
    )
    parser.add_argument("spec", nargs="?", help=f"job spec (YAML/JSON); default: ${SPEC_ENV}")
    parser.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a spec field",
    )
    parser.add_argument(
        "--run-dir",
        help="where metrics.jsonl and summary.json go "
        "(default: $CTXLAUNCH_RUN_DIR, else runs/<job name>)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from ctxlaunch.runtime.trainer import stopsignal

    stopsignal.install()  # before the slow imports: a stop signal must not kill the rank
    args = parse_args(argv)
    rank_tag = "[rank ?]"
    try:
        spec = load_job_spec(args)
        from ctxlaunch.runtime.parallel import distenv

        denv = distenv.detect()
        rank_tag = f"[rank {denv.rank}]"
        if spec.training.heal.elastic:
            from ctxlaunch.runtime.trainer.healing import check_allocation

            check_allocation(spec, denv)
        else:
            check_world_size(spec, denv)
        if spec.training.checkpoint.dir:
            check_writable(spec.training.checkpoint.dir, denv.rank)
            if denv.rank == 0:
                hold_checkpoint_dir(spec)
        missing = spec.training.data.missing_files()
        init_from = spec.model.init_from
        if init_from is not None and not (Path(init_from) / "config.json").is_file():
            missing.append(
                f"model.init_from {init_from}: no config.json (a Hugging Face "
                "checkpoint directory holds config.json and model.safetensors)"
            )
        missing += missing_packages(spec)
        if missing:
            raise SetupError("; ".join(missing))
        import torch

        if spec.cluster.gpu != "cpu" and not torch.cuda.is_available():
            raise SetupError(
                f"cluster.gpu = {spec.cluster.gpu} but no CUDA device is visible; "
                "use cluster.gpu: cpu to run on the CPU"
            )
        run_dir = Path(args.run_dir or os.environ.get(RUN_DIR_ENV) or default_run_dir(spec.name))
        run_dir.mkdir(parents=True, exist_ok=True)
    except (SpecError, SetupError, CheckpointDirError, DirectoryInUse) as exc:
        print(f"{rank_tag} error: {exc}", file=sys.stderr, flush=True)
        where = args.run_dir or os.environ.get(RUN_DIR_ENV)
        if where:
            rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
            record_exit(Path(where), rank, exitcodes.BAD_INPUT)
        return exitcodes.BAD_INPUT

    return _run(spec, denv, run_dir, rank_tag)


def hold_checkpoint_dir(spec: JobSpec) -> None:
    """Take the job's checkpoint directory for this run's life (ctxlaunch.contract.dirlock):
    DirectoryInUse naming the job that has it, before anything is built or written (a run of
    this same job, requeued, waits for its earlier run to let go first)."""
    directory = spec.training.checkpoint.dir
    assert directory is not None
    job = os.environ.get(JOB_ID_ENV) or spec.name
    if not dirlock.hold(directory, job):
        print(
            f"[rank 0] warning: training.checkpoint.dir {directory} is on a filesystem without "
            "record locks: nothing stops another job from writing it too",
            file=sys.stderr,
            flush=True,
        )


def missing_packages(spec: JobSpec) -> list[str]:
    """What this job needs of the `train` extra beyond torch that is not installed, said with
    the line that installs it: found before the process group forms, not in a rank's
    traceback."""
    import importlib.util

    needed = {
        "safetensors": spec.model.init_from is not None,
        "deepspeed": spec.state_engine == "deepspeed",
        "numpy": spec.training.data.source == "tokens",
    }
    return [
        f"this job needs the {name} package: pip install 'ctxlaunch[train]'"
        for name, used in needed.items()
        if used and importlib.util.find_spec(name) is None
    ]


def record_exit(run_dir: Path, rank: int | str, code: int) -> None:
    """Leave this rank's exit status where a launcher can read it (torchrun reports 1 for any
    failure; the job's status must say OOM or preempted)."""
    try:
        write_exit_code(run_dir, int(rank), code)
    except OSError:
        pass


def _run(spec: JobSpec, denv: DistEnv, run_dir: Path, rank_tag: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from ctxlaunch.runtime.checkpointing.checkpoint import CheckpointWriteError
    from ctxlaunch.runtime.telemetry.training import TrainingTelemetry
    from ctxlaunch.runtime.telemetry.trainjob_status import trainjob_progress
    from ctxlaunch.runtime.trainer import fastpath, faults, healing, heartbeat
    from ctxlaunch.runtime.trainer.loop import Trainer

    heartbeat.start(run_dir, denv.rank)
    device = join_process_group(spec, denv)
    log = (lambda text: print(text, flush=True)) if denv.rank == 0 else (lambda text: None)
    # training.heal: every rank agrees on the layout of this run before anything is built.
    settled = healing.settle(spec, denv, device, run_dir, log)
    if settled.exit_code is not None:
        record_exit(run_dir, denv.rank, settled.exit_code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(settled.exit_code)
    spec = settled.spec
    code = exitcodes.FAILED
    telemetry = TrainingTelemetry(
        spec,
        rank=denv.rank,
        local_rank=denv.local_rank,
        device=device,
        log=lambda text: print(f"{rank_tag} {text}", file=sys.stderr, flush=True),
        run_dir=run_dir,
    )
    if settled.decision is not None and settled.decision.replanned:
        telemetry.replanned(settled.decision)
    # A TrainJob's rank 0 writes its progress into the TrainJob's status (trainer_status).
    progress = trainjob_progress(denv.rank, log)
    trainer = None
    try:
        ctx = rank_context(spec, denv)
        attention = fastpath.choose_attention_kernel(spec, ctx, device)
        telemetry.attention_kernel(attention)
        log(
            f"ctxlaunch: {spec.name}: {denv.world_size} ranks ({denv.launcher}), dp {ctx.dims.dp} "
            f"x cp {ctx.dims.cp} ({spec.parallel.cp_algorithm}, {ctx.dims.cp_sharding}) x tp {ctx.dims.tp} x pp "
            f"{ctx.dims.pp} (blocks per stage {list(spec.stage_layers)}), "
            f"ZeRO-{spec.training.zero_stage}, {spec.model.dtype}, device {device.type}, "
            + fastpath.describe(spec, device, attention)
        )
        if denv.rank == 0:
            events.append_event(
                run_dir, events.STARTED, restart=events.restart_count(), world_size=denv.world_size
            )
        trainer = Trainer(spec, ctx, device, run_dir if denv.rank == 0 else None, log=log)
        trainer.prediction = telemetry.job_prediction
        observers = [telemetry.on_step] + ([progress.on_step] if progress is not None else [])
        code = trainer.run(observers=observers, eval_observers=[telemetry.on_eval])
    except torch.OutOfMemoryError as exc:
        step = trainer.step + 1 if trainer is not None else 0
        message = telemetry.on_oom(step)
        print(f"{rank_tag} error: {message}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        healing.record_out_of_memory(
            spec,
            rank=denv.rank,
            step=step,
            phase=trainer.phase if trainer is not None else "start",
            message=f"{message}; {exc}",
            device=device,
            capacity_bytes=settled.capacity_bytes,
            run_dir=run_dir,
            injected=faults.ENV in str(exc),
        )
        code = exitcodes.OOM
    except (CheckpointWriteError, CheckpointDamaged, CheckpointRefused) as exc:
        # One sentence naming the file: the traceback would say nothing more.
        print(f"{rank_tag} error: {exc}", file=sys.stderr, flush=True)
        events.append_event(run_dir, events.FAILURE, rank=denv.rank, cause=str(exc))
        # Another model's checkpoint is the spec's mistake (its model or checkpoint.dir).
        another = isinstance(exc, CheckpointOfAnotherModel)
        code = exitcodes.BAD_INPUT if another else exitcodes.FAILED
    except (Exception, CheckpointException):  # torch's CheckpointException is a BaseException
        # A dead peer surfaces here as a gloo/NCCL error or a timeout: report and leave at
        # once, never wait on the group again. A peer that is alive but silent is named.
        hang = heartbeat.describe_hang(
            run_dir, denv.rank, denv.world_size, spec.training.timeout_seconds
        )
        print(
            f"{rank_tag} error: " + (hang or "training failed") + f"\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        events.append_event(
            run_dir, events.FAILURE, rank=denv.rank, cause=hang or "training failed"
        )
        code = exitcodes.FAILED
    telemetry.close(code)
    if progress is not None:
        progress.close(code)
    record_exit(run_dir, denv.rank, code)
    if code in (exitcodes.OK, exitcodes.PREEMPTED):
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: after a failure it could block on a broken group, and
    # even after success gloo's threads sometimes abort in C++ static destructors. Everything
    # worth keeping (checkpoints, metrics, the exit status) is written and closed by now.
    os._exit(code)
