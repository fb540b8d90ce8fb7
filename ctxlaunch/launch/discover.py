"""The cluster in front of the user, as `ctxlaunch init` finds it: a Slurm partition with GPUs
(`sinfo`), Kubernetes nodes with GPUs (`kubectl get nodes`), or this machine (`nvidia-smi`, else
its CPU). Each finder asks its tool with a short timeout and answers None where the tool is
missing, cannot reach its cluster or shows no GPUs; the parsers are pure functions of the
tools' text."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

TOOL_TIMEOUT_SECONDS = 10.0

GPU_NAMES: tuple[tuple[str, str], ...] = (
    ("h200", "H200"),
    ("h100", "H100"),
    ("b200", "B200"),
    ("gb200", "B200"),
    ("a100-sxm4-40gb", "A100-40GB"),
    ("a100-pcie-40gb", "A100-40GB"),
    ("a100-40gb", "A100-40GB"),
    ("a100", "A100"),
    ("l40s", "L40S"),
)
"""A lowercase fragment of a GPU's name as Slurm's GRES, the GPU operator's product label or
nvidia-smi spell it -> the GPU table's key (contract.hardware.GPUS); the first that matches."""


@dataclass(frozen=True)
class Cluster:
    """What was found: where jobs go, on how many nodes of how many GPUs of which type."""

    target: str
    """local, slurm or kubernetes (cluster.target)."""
    gpu: str
    """The GPU table's key, or cpu."""
    nodes: int
    gpus_per_node: int
    source: str
    """What was asked and what it said, in words."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The target's own spec settings found (a Slurm partition)."""


def gpu_type(name: str) -> str | None:
    """The GPU table's key for a GPU named `name` by a tool, or None where unknown."""
    lowered = name.lower().replace("_", "-").replace(" ", "-")
    return next((key for fragment, key in GPU_NAMES if fragment in lowered), None)


def _run(command: list[str]) -> str | None:
    """The command's stdout, or None where it is missing, fails or takes too long."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_SECONDS, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


_GRES_GPU = re.compile(r"gpu(?::([A-Za-z0-9_.-]+))?:(\d+)")


def parse_sinfo(text: str) -> Cluster | None:
    """The Slurm partition to run on from `sinfo -h -o "%P %D %G"` (partition, node count,
    GRES per line): the default partition (its name ends in *) where it has GPUs, else the one
    with the most GPUs per node; None where no partition has GPUs."""
    best: tuple[bool, int, int, str, str] | None = None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        name, nodes, gres = parts[0], int(parts[1]), " ".join(parts[2:])
        found = _GRES_GPU.search(gres)
        if found is None:
            continue
        kind, count = found.group(1) or "", int(found.group(2))
        default = name.endswith("*")
        candidate = (default, count, nodes, name.rstrip("*"), kind)
        if best is None or candidate[:3] > best[:3]:
            best = candidate
    if best is None:
        return None
    _, count, nodes, partition, kind = best
    return Cluster(
        target="slurm",
        gpu=gpu_type(kind) or "H100",
        nodes=nodes,
        gpus_per_node=count,
        source=f"sinfo: partition {partition}, {nodes} nodes of {count} GPUs"
        + (f" ({kind})" if kind else " (GPU type not in its GRES: H100 assumed, set cluster.gpu)"),
        settings={"partition": partition},
    )


def parse_kubectl_nodes(text: str) -> Cluster | None:
    """The GPU nodes of `kubectl get nodes -o json`: the GPU product with the most nodes (its
    allocatable nvidia.com/gpu per node, the GPU operator's nvidia.com/gpu.product label);
    None where no node offers GPUs."""
    try:
        items = json.loads(text).get("items", [])
    except (ValueError, AttributeError):
        return None
    groups: dict[tuple[str, int], int] = {}
    for node in items:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        try:
            count = int(allocatable.get("nvidia.com/gpu", 0))
        except (TypeError, ValueError):
            continue
        if count <= 0:
            continue
        labels = (node.get("metadata") or {}).get("labels") or {}
        product = labels.get("nvidia.com/gpu.product", "")
        groups[(product, count)] = groups.get((product, count), 0) + 1
    if not groups:
        return None
    (product, count), nodes = max(groups.items(), key=lambda item: (item[1], item[0][1]))
    return Cluster(
        target="kubernetes",
        gpu=gpu_type(product) or "H100",
        nodes=nodes,
        gpus_per_node=count,
        source=f"kubectl get nodes: {nodes} nodes of {count} GPUs"
        + (
            f" ({product})" if product else " (no gpu.product label: H100 assumed, set cluster.gpu)"
        ),
    )


def parse_nvidia_smi(text: str) -> Cluster | None:
    """This machine's GPUs from `nvidia-smi --query-gpu=name --format=csv,noheader`."""
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        return None
    return Cluster(
        target="local",
        gpu=gpu_type(names[0]) or "H100",
        nodes=1,
        gpus_per_node=len(names),
        source=f"nvidia-smi: {len(names)} x {names[0]}",
    )


def this_machine() -> Cluster:
    """This machine: its GPUs where nvidia-smi lists some, else two CPU processes (the demo's
    shape) on its cores."""
    text = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    found = parse_nvidia_smi(text) if text else None
    if found is not None:
        return found
    cores = os.cpu_count() or 1
    return Cluster(
        target="local",
        gpu="cpu",
        nodes=1,
        gpus_per_node=2 if cores >= 2 else 1,
        source=f"this machine: no GPU, {cores} CPU cores (two CPU ranks)",
    )


def find_cluster(target: str | None = None) -> Cluster:
    """The cluster to write a spec for: of `target` where given (slurm, kubernetes, local),
    else the first that answers with GPUs of Slurm, Kubernetes and this machine."""
    finders = {
        "slurm": lambda: parse_sinfo(_run(["sinfo", "-h", "-o", "%P %D %G"]) or ""),
        "kubernetes": lambda: parse_kubectl_nodes(
            _run(["kubectl", "get", "nodes", "-o", "json", "--request-timeout=5s"]) or ""
        ),
    }
    if target == "local":
        return this_machine()
    for name in [target] if target else list(finders):
        found = finders[name]() if name in finders else None
        if found is not None:
            return found
    if target:
        # Asked for, not found: its shape is left for the user to say (cluster.gpu and nodes).
        return Cluster(
            target=target,
            gpu="H100",
            nodes=1,
            gpus_per_node=8,
            source=f"no {target} GPUs answered here: one node of 8 H100 assumed, set cluster.*",
        )
    return this_machine()
