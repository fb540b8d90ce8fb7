"""Checkpoints that resume at any layout (torch.distributed.checkpoint, ZeRO-0 and FSDP2).

Every tensor is saved under its name in the whole model, so the same checkpoint reads back at
any TP, PP, CP or DP degree: a job requeued onto a differently sized allocation goes on. A
TP-split weight is saved as its TP parts (q, k, v of the fused projection; gate and up), each a
DTensor sharded over the TP group along the split dimension; DCP maps the saved shards onto
whatever split the loading layout has. A pipeline stage saves and loads only its own blocks'
names. Under FSDP2 each rank first gathers its TP slice over DP x CP (one slice at a time).
An expert parameter is saved whole too, (E, ...), as a DTensor sharded along the experts over
the EP group, so a checkpoint saved at one EP degree resumes at another.

    model/<name>[#part]        weights
    exp_avg/<name>[#part]      Adam first moments
    exp_avg_sq/<name>[#part]   Adam second moments
    step/<name>                Adam step count
    scheduler                  the LR schedule's state
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ctxlaunch.runtime.modeling.weight_sharding import Sharding, write_local

MOMENTS = ("exp_avg", "exp_avg_sq")


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class CheckpointState:
    """The state dict of one rank's slice of the model and its AdamW states."""

    def __init__(
        self,
        named_parameters: list[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        plan: dict[str, Sharding | None],
        tp: int,
        tp_group: dist.ProcessGroup | None,
        device: torch.device,
        experts: frozenset[str] = frozenset(),
        ep_group: dist.ProcessGroup | None = None,
    ):
        from torch.distributed.device_mesh import DeviceMesh

        self.params, self.optimizer, self.scheduler = named_parameters, optimizer, scheduler
        self.plan, self.tp = plan, tp
        self.mesh = None
        if tp > 1:
            assert tp_group is not None  # tp > 1
            self.mesh = DeviceMesh.from_group(tp_group, device.type)
        self.experts = experts
        """The expert parameters (their local tensors are this rank's experts)."""
        self.ep_mesh = None if ep_group is None else DeviceMesh.from_group(ep_group, device.type)

    def _ensure_moments(self) -> None:
        """A fresh optimizer has no state yet; loading needs tensors to load into."""
        if self.optimizer is None:
            return
        for _, param in self.params:
            state = self.optimizer.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in MOMENTS:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _parts(self, name: str, local: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import Shard

        if name in self.experts and self.ep_mesh is not None:
            return [
                (
                    name,
                    DTensor.from_local(
                        local.contiguous(), self.ep_mesh, [Shard(0)], run_check=False
                    ),
                )
            ]
        sharding = self.plan[name]
        if sharding is None:
            return [(name, local)]
        sizes = [size // self.tp for size in sharding.parts]
        pieces = local.split(sizes, dim=sharding.dim)
        if self.mesh is None:
            return [(f"{name}#{i}", piece) for i, piece in enumerate(pieces)]
        return [
            (
                f"{name}#{i}",
                DTensor.from_local(
                    piece.contiguous(), self.mesh, [Shard(sharding.dim)], run_check=False
                ),
            )
            for i, piece in enumerate(pieces)
        ]

    def _tensors(self, param: nn.Parameter) -> list[tuple[str, torch.Tensor]]:
        """(key, tensor) of what is saved for `param`: the weight, and its moments when an
        optimizer is in hand (evaluation loads weights only)."""
        if self.optimizer is None:
            return [("model", param)]
        state = self.optimizer.state[param]
        return [("model", param), *((k, state[k]) for k in MOMENTS)]

    def state_dict(self) -> dict:
        self._ensure_moments()
        out: dict = {}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        with torch.no_grad():
            for name, param in self.params:
                for key, tensor in self._tensors(param):
                    for part, value in self._parts(name, _whole(tensor.detach())):
                        out[f"{key}/{part}"] = value
                if self.optimizer is not None:
                    out[f"step/{name}"] = self.optimizer.state[param]["step"]
        return out

    def load_into_place(self, state: dict) -> None:
        """Write a loaded state dict (made by `state_dict`, filled by DCP) back."""
        with torch.no_grad():
            for name, param in self.params:
                sharding = self.plan[name]
                for key, target in self._tensors(param):
                    if sharding is None:
                        value = state[f"{key}/{name}"]
                        value = value.to_local() if hasattr(value, "to_local") else value
                    else:
                        pieces = [state[f"{key}/{name}#{i}"] for i in range(len(sharding.parts))]
                        pieces = [p.to_local() if hasattr(p, "to_local") else p for p in pieces]
                        value = torch.cat(pieces, dim=sharding.dim)
                    write_local(target, value)
                if self.optimizer is not None:
                    self.optimizer.state[param]["step"].copy_(state[f"step/{name}"])
        if self.optimizer is None or self.scheduler is None:
            return
        self.scheduler.load_state_dict(state["scheduler"])
        # The schedule's state holds its step, not the optimizer's current learning rate.
        for group, lr in zip(
            self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_dict(), checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from ctxlaunch.runtime.checkpointing.checkpoint_integrity import (
            check_dcp_files,
            load_failure,
        )
        from ctxlaunch.runtime.checkpointing.safe_unpickle import (
            SafeFileSystemReader,
            SafeLoadPlanner,
        )

        metadata = check_dcp_files(path)  # a missing or cut-short file, named, before reading
        state = self.state_dict()
        check_saved_shapes(metadata, state, path)
        try:
            # Through the allow-list: a checkpoint's pickles never run code (safe_unpickle.py).
            dcp.load(
                state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner()
            )
        except (Exception, CheckpointException) as exc:  # the latter is a BaseException
            raise load_failure(exc, path) from None
        self.load_into_place(state)


def check_saved_shapes(metadata: object, state: dict, path: Path) -> None:
    """Every tensor `state` loads is in the checkpoint's metadata with the same whole shape; a
    CheckpointOfAnotherModel naming the checkpoint, the tensor and both shapes otherwise (torch's own
    error names neither the file nor the model, and comes after every rank has started to
    read). The optimizer's moments have their weight's shape, so the weights are named."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ctxlaunch.runtime.checkpointing.safe_unpickle import CheckpointOfAnotherModel

    saved = getattr(metadata, "state_dict_metadata", None) or {}
    for key in sorted(state, key=lambda k: (not k.startswith("model/"), k)):
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue  # the scheduler's state and Adam's step counts are not shaped
        name = key.split("/", 1)[1].split("#", 1)[0]
        entry = saved.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointOfAnotherModel(
                f"checkpoint {path} has no {key.split('/', 1)[0]} tensor for {name}: it was "
                "saved by a different model"
            )
        if tuple(entry.size) != tuple(value.shape):
            raise CheckpointOfAnotherModel(
                f"checkpoint {path} holds {key} of shape {list(entry.size)}, but this model's "
                f"{name} needs {list(value.shape)}: it was saved by a different model"
            )
