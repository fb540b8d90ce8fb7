"""Setting up one rank of a job: the spec it runs, the check that the launcher started the
ranks the spec describes, joining the job's process group, and the rank's place in the layout.
The trainer (ctxlaunch.runtime.trainer.main) and `ctxlaunch eval`'s ranks
(ctxlaunch.runtime.evaluation.eval_main) both start this way."""

from __future__ import annotations

import argparse
import datetime
import os
from typing import TYPE_CHECKING

from ctxlaunch.contract.loader import apply_overrides, parse_yaml, read_spec_data, validate_spec
from ctxlaunch.contract.rundir import SPEC_ENV, cpu_threads_per_rank

if TYPE_CHECKING:
    import torch

    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.parallel.context import ParallelContext
    from ctxlaunch.runtime.parallel.distenv import DistEnv


class SetupError(Exception):
    """A problem found before any work started (exit 2)."""


def load_job_spec(args: argparse.Namespace) -> JobSpec:
    """The validated spec from the SPEC argument or $CTXLAUNCH_SPEC_JSON, with --set applied."""
    if args.spec:
        data, source = read_spec_data(args.spec), args.spec
    elif os.environ.get(SPEC_ENV):
        data, source = parse_yaml(os.environ[SPEC_ENV], f"${SPEC_ENV}"), f"${SPEC_ENV}"
    else:
        raise SetupError(f"no spec: pass a spec file or set {SPEC_ENV}")
    spec = validate_spec(apply_overrides(data, args.overrides), source)
    return spec


def check_world_size(spec: JobSpec, denv: DistEnv) -> None:
    """The launcher started as many ranks as the spec describes, else SetupError."""
    expected = spec.cluster.world_size
    if denv.world_size != expected:
        raise SetupError(
            f"the launcher started {denv.world_size} ranks but the spec describes "
            f"{expected} (cluster.nodes x cluster.gpus_per_node); launch {expected}"
        )


def join_process_group(spec: JobSpec, denv: DistEnv) -> torch.device:
    """Pick this rank's device (the local GPU, else the CPU with its share of the threads),
    join the job's process group (NCCL or gloo, with the spec's timeout), and return the
    device. The trainer and `ctxlaunch eval` start each rank this way."""
    import torch
    import torch.distributed as dist

    from ctxlaunch.cp.comm import set_wait_timeout
    from ctxlaunch.runtime import vml
    from ctxlaunch.runtime.parallel.distenv import export_for_torch

    vml.warm_up()  # before any multi-threaded CPU op: a first VML call can be inexact (vml.py)
    use_cuda = spec.cluster.gpu != "cpu"  # the entry checked that CUDA is there
    device = torch.device("cuda", denv.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # srun sets no thread count
        torch.set_num_threads(cpu_threads_per_rank(spec.cluster.gpus_per_node))
    export_for_torch(denv)
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method="env://",
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=datetime.timedelta(seconds=spec.training.timeout_seconds),
    )
    set_wait_timeout(spec.training.timeout_seconds)
    return device


def rank_context(spec: JobSpec, denv: DistEnv) -> ParallelContext:
    """This rank's place in the spec's DP x CP x TP x PP layout (its groups)."""

    from ctxlaunch.runtime.parallel.context import build_context

    return build_context(spec.parallel_dims, rank=denv.rank)
