"""Who am I in the job: rank, world, local rank and the rendezvous, from torchrun, Slurm or the
Kubeflow PyTorchJob environment (or a single process)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ctxlaunch.contract.rundir import slurm_rendezvous_port


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """torchrun (also PyTorchJob, whose pods run torchrun), slurm, or single."""


def detect(env: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables. torchrun (and the training-operator) set RANK and
    WORLD_SIZE; `srun` sets SLURM_PROCID and SLURM_NTASKS."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_node(env),
            master_port=int(
                env.get("MASTER_PORT") or slurm_rendezvous_port(int(env.get("SLURM_JOB_ID", "0")))
            ),
            launcher="slurm",
        )
    # A lone process rendezvous with itself: any free port, so that two single-process jobs
    # on one machine (or a job beside anything holding torch's default 29500) do not collide.
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=int(env.get("MASTER_PORT") or free_local_port()),
        launcher="single",
    )


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds at the moment."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _first_slurm_node(env: Mapping[str, str]) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    result = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return result.stdout.split()[0]


def export_for_torch(dist_env: DistEnv) -> None:
    """Make the env:// rendezvous see what the launcher said."""
    os.environ.update(
        RANK=str(dist_env.rank),
        WORLD_SIZE=str(dist_env.world_size),
        LOCAL_RANK=str(dist_env.local_rank),
        MASTER_ADDR=dist_env.master_addr,
        MASTER_PORT=str(dist_env.master_port),
    )
