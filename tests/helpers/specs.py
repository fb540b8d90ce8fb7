"""A valid job spec to vary in tests, and the problems an invalid variant reports."""

from __future__ import annotations

import copy

import pytest

from ctxlaunch.contract.loader import SpecError, apply_overrides, validate_spec

SPEC = {
    "name": "job",
    "model": {"preset": "llama3-8b"},
    "training": {"seq_len": 131072},
    "parallel": {"cp": 8},
    "cluster": {"target": "slurm", "nodes": 4, "gpus_per_node": 8, "gpu": "H100"},
}
"""A valid spec: Llama 3 8B at 128K tokens, CP 8, on 4 nodes of 8 H100 under Slurm."""


def make(**changes) -> dict:
    """SPEC with dotted-path changes applied."""
    data = copy.deepcopy(SPEC)
    return apply_overrides(data, [f"{k}={v}" for k, v in changes.items()])


def problems(data: dict) -> dict[str, str]:
    """Field path -> its messages (joined) for an invalid spec."""
    with pytest.raises(SpecError) as info:
        validate_spec(data)
    found: dict[str, str] = {}
    for p in info.value.problems:
        found[p.path] = (found[p.path] + "\n" if p.path in found else "") + p.message
    return found
