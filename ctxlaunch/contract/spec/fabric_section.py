"""The fabric section of the job spec: the interconnect, and the NCCL environment it needs."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from ctxlaunch.contract.hardware import NetworkType
from ctxlaunch.contract.spec.fields import ENV_NAME, INT32_MAX, PositiveInt, _Strict
from ctxlaunch.contract.spec.secret_refs import EnvValue


class FabricSpec(_Strict):
    """The interconnect, and the NCCL environment it needs."""

    nvlink_domain: PositiveInt | None = None
    """GPUs per NVLink/NVSwitch domain; default from the GPU type (8, or 1 for PCIe-only)."""
    network: NetworkType = "infiniband-ndr"
    """Inter-node network; picks the NCCL defaults (see ctxlaunch.contract.hardware.FABRIC_NCCL_ENV)."""
    hcas: list[str] = []
    """HCA names for NCCL_IB_HCA, matched exactly (rendered with a leading '=')."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for bootstrap (e.g. eth0, or ^lo,docker)."""
    gid_index: int | None = Field(None, ge=0, le=INT32_MAX)
    """NCCL_IB_GID_INDEX; default 3 on RoCE (RoCE v2)."""
    gdr_level: str | None = None
    """NCCL_NET_GDR_LEVEL (LOC, PIX, PXB, PHB, SYS)."""
    topo_file: str | None = None
    """NCCL_TOPO_FILE: a topology XML (cloud VMs)."""
    nccl: dict[str, str] = {}
    """Per-job NCCL/torch variables, overriding the fabric defaults key by key. The names the
    launchers set are refused here and in env: CTXLAUNCH_*, the rendezvous and rank variables
    (MASTER_ADDR, RANK, WORLD_SIZE, ...), TORCHELASTIC_* and PET_*."""
    env: dict[str, EnvValue] = {}
    """Any other environment for the trainer (overrides everything else). A value is text,
    or a reference that keeps a secret out of every rendered file: {secret: {name, key}} (a
    Kubernetes Secret's key), {from_env: NAME} (a variable where sbatch or ctxlaunch runs) or
    {from_file: PATH} (a file's text, read where the job starts)."""

    @field_validator("hcas")
    @classmethod
    def _hcas(cls, value: list[str]) -> list[str]:
        for hca in value:
            if not re.fullmatch(r"^[A-Za-z0-9_]+(:\d+)?$", hca):
                raise ValueError(f"{hca!r} is not an HCA name (e.g. mlx5_0 or mlx5_0:1)")
        return value

    @field_validator("gdr_level")
    @classmethod
    def _gdr(cls, value: str | None) -> str | None:
        if (
            value is not None
            and value not in {"LOC", "PIX", "PXB", "PHB", "SYS"}
            and not value.isdigit()
        ):
            raise ValueError(f"{value!r}: use LOC, PIX, PXB, PHB, SYS or a number")
        return value

    @field_validator("nccl", "env")
    @classmethod
    def _env(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, setting in value.items():
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name in SHELL_OWN:
                raise ValueError(
                    f"{name!r} is the shell's own (bash sets or reads it itself): "
                    "choose another name"
                )
            reason = launcher_own(name)
            if reason is not None:
                raise ValueError(f"{name!r} is {reason}: choose another name")
            if isinstance(setting, str) and "\x00" in setting:
                raise ValueError(f"{name}: the value contains a NUL byte")
        return value


SHELL_OWN = frozenset(
    {"_", "PWD", "OLDPWD", "SHLVL", "IFS", "SHELLOPTS", "BASHOPTS", "BASH_ENV", "ENV"}
)
"""Names bash sets itself in the batch script (so an export of them would not hold) or reads
at start-up (BASH_ENV and ENV: a file it sources)."""


RENDEZVOUS_OWN = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "NODE_RANK",
    }
)
"""The rendezvous and rank variables the launchers set for each rank (the batch script,
torchrun, the training operator): one given here would point ranks at another job or give
two ranks one number."""
LAUNCHER_OWN_PREFIXES = {
    "CTXLAUNCH_": "ctxlaunch's own (its variables carry the validated spec, the run directory, "
    "the job's identity and its test switches; a value here would replace what `validate` saw)",
    "TORCHELASTIC_": "torchrun's own (its agent sets it for each rank)",
    "PET_": "the training operator's own (it sets torchrun's settings in the pods)",
}
"""Name prefixes the launchers own, each with whose they are."""

ATTENTION_SWITCHES = frozenset(
    {"CTXLAUNCH_ATTENTION_KERNEL", "CTXLAUNCH_MASKED_ATTENTION", "CTXLAUNCH_CP_FUSED_MERGE"}
)
"""ctxlaunch's attention switches (ctxlaunch.cp): read by the ranks, never set by a launcher,
so a job may carry them in fabric.env (on Kubernetes, the only way into a pod)."""


def launcher_own(name: str) -> str | None:
    """Whose variable `name` is when a launcher sets it for the ranks (ctxlaunch, torchrun,
    the training operator), in words; None for a name the spec may set."""
    if name in ATTENTION_SWITCHES:
        return None
    if name in RENDEZVOUS_OWN:
        return "a rendezvous variable the launcher sets for each rank"
    return next(
        (whose for prefix, whose in LAUNCHER_OWN_PREFIXES.items() if name.startswith(prefix)),
        None,
    )
