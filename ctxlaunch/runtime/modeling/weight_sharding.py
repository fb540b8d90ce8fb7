"""How the model's weights are split: each parameter's tensor-parallel sharding (`Sharding`,
the plan `shardings` gives for a whole model), and writing a rank's slice into a parameter
that FSDP2 may shard further over DP x CP (a DTensor whose local rows are this rank's chunk).
Materialisation, checkpoint loading and the Hugging Face import all write through these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ctxlaunch.contract.families.experts import is_moe_parameter

if TYPE_CHECKING:
    from ctxlaunch.runtime.modeling.model import Transformer


@dataclass(frozen=True)
class Sharding:
    """How one parameter splits over TP: along `dim`, each of the consecutive `parts` of that
    dimension split into t equal pieces (q/k/v and gate/up are fused, so a rank's slice of
    the fused weight is its slice of each part)."""

    dim: int
    parts: tuple[int, ...]

    def shard(self, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        pieces = full.split(list(self.parts), dim=self.dim)
        return torch.cat([p.chunk(tp, dim=self.dim)[tp_rank] for p in pieces], dim=self.dim)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        tp = len(shards)
        local = [p // tp for p in self.parts]
        per_rank = [s.split(local, dim=self.dim) for s in shards]
        return torch.cat(
            [torch.cat([r[i] for r in per_rank], dim=self.dim) for i in range(len(self.parts))],
            dim=self.dim,
        )


def shardings(model: Transformer) -> dict[str, Sharding | None]:
    """Every parameter name of the full model -> its TP sharding (None: replicated). A
    mixture-of-experts feed-forward runs on each TP rank's own (sequence-parallel) tokens with
    whole weights, as Megatron's expert tensor parallel degree 1: none of it is split."""
    out: dict[str, Sharding | None] = {}
    for name, param in model.named_parameters():
        if is_moe_parameter(name):
            out[name] = None
            continue
        leaf = name.rsplit(".", 2)
        kind = ".".join(leaf[-2:])
        if kind in ("wqkv.weight", "wqkv.bias"):
            # The biases split with their output columns: each rank keeps its heads' biases.
            attn = model.block_modules()[0].attn
            d = attn.head_dim
            out[name] = Sharding(0, (attn.heads * d, attn.kv_heads * d, attn.kv_heads * d))
        elif kind == "w_gate_up.weight":
            f = param.shape[0] // 2
            out[name] = Sharding(0, (f, f))
        elif kind == "attn.sinks":
            out[name] = Sharding(0, (param.shape[0],))  # one per query head: split with them
        elif kind in ("wo.weight", "w_down.weight"):
            out[name] = Sharding(1, (param.shape[1],))
        elif name in ("embed.weight", "head.weight"):
            out[name] = Sharding(0, (param.shape[0],))
        else:
            out[name] = None
    return out


def write_local(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's TP slice into a parameter or moment (its FSDP chunk if sharded)."""
    if not isinstance(target, DTensor):
        target.copy_(value)
        return
    mesh = target.device_mesh
    chunks = value.chunk(mesh.size(), dim=0)
    index = mesh.get_local_rank()
    if index < len(chunks) and target._local_tensor.numel():
        target._local_tensor.copy_(chunks[index])


def local_rows(target: torch.Tensor, rows: int) -> tuple[int, int]:
    """[start, stop) of the rows (dim 0) of a TP slice with `rows` rows that `write_local`
    keeps in `target`: all of them, or its FSDP chunk (torch.chunk's split over DP x CP)."""
    if not isinstance(target, DTensor):
        return 0, rows
    if not target._local_tensor.numel():
        return 0, 0
    mesh = target.device_mesh
    return chunk_rows(rows, mesh.size(), mesh.get_local_rank())


def chunk_rows(rows: int, chunks: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` of `rows` rows as torch.chunk splits them (chunks of
    ceil(rows / chunks), the last shorter, possibly none)."""
    size = -(-rows // chunks)
    return min(index * size, rows), min((index + 1) * size, rows)


def write_rows(target: torch.Tensor, rows: torch.Tensor) -> None:
    """Copy the rows `local_rows` named (read from elsewhere, not sliced here) into `target`."""
    local = target._local_tensor if isinstance(target, DTensor) else target
    if local.numel():
        local.copy_(rows)
