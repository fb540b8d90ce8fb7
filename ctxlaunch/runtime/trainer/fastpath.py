"""The trainer's fast-path switches (`training.compile`, `training.fused_optimizer`) resolved
for the device at hand: auto means on for CUDA, off on the CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec


def resolve(setting: bool | Literal["auto"], device: torch.device) -> bool:
    """A switch's value on `device`: as given, or for auto, whether the device is CUDA."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def attention_kernel(device: torch.device, dtype: str) -> str:
    """The attention kernel the trainer's attention calls run on `device` for the model dtype
    (ctxlaunch.cp.kernels picks it by dtype and head dim; no measurement yet)."""
    if device.type != "cuda":
        return "cpu flash"
    return "flash" if dtype in ("bf16", "fp16") else "memory-efficient"


def describe(spec: JobSpec, device: torch.device) -> str:
    """The run's first log line's account of the fast paths on `device`."""
    t = spec.training
    fused = resolve(t.fused_optimizer, device) and spec.state_engine != "deepspeed"
    return (f"attention {attention_kernel(device, spec.model.dtype)}, compile "
            f"{'on' if resolve(t.compile, device) else 'off'}, AdamW "
            f"{'fused' if fused else 'foreach'}")
