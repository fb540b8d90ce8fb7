"""The trainer's fast-path switches (`training.compile`, `training.fused_optimizer`) resolved
for the device at hand: auto means on for CUDA, off on the CPU."""

from __future__ import annotations

from typing import Literal

import torch


def resolve(setting: bool | Literal["auto"], device: torch.device) -> bool:
    """A switch's value on `device`: as given, or for auto, whether the device is CUDA."""
    return device.type == "cuda" if setting == "auto" else bool(setting)
