"""The weights `ctxlaunch eval` scores: which checkpoint (--checkpoint, else the newest committed
one, else the model.init_from checkpoint as imported) and loading it into this rank's part of
the model at the spec's layout."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.parallel.context import ParallelContext


def load_weights(
    parts: Any, spec: JobSpec, ctx: ParallelContext, device: torch.device, path: Path
) -> None:
    """This rank's weights from a checkpoint: the layout-independent DCP format at any layout,
    or a DeepSpeed checkpoint (consolidated by DeepSpeed's own zero_to_fp32)."""
    if (path / ".metadata").is_file():
        from ctxlaunch.runtime.checkpointing.reshard import CheckpointState

        CheckpointState(
            parts.named_parameters(),
            None,
            None,
            parts.plan,
            ctx.dims.tp,
            ctx.tp_group,
            device,
            frozenset(parts.experts),
            ctx.ep_group,
        ).load(path)
        return
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ctxlaunch.runtime.checkpointing.safe_unpickle import deepspeed_reads_weights_only
    from ctxlaunch.runtime.modeling.weight_sharding import write_local

    with contextlib.redirect_stdout(sys.stderr), deepspeed_reads_weights_only(path):
        state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    with torch.no_grad():
        for name, param in parts.named_parameters():
            if name not in state:
                raise ValueError(
                    f"checkpoint {path} has no weight {name!r}: it was saved by a different model"
                )
            saved = state[name]
            if tuple(saved.shape) != tuple(param.shape):
                raise ValueError(
                    f"checkpoint {path} holds {name} of shape {list(saved.shape)}, but this "
                    f"model needs {list(param.shape)}: it was saved by a different model"
                )
            write_local(param, saved.to(param.dtype))


def checkpoint_to_load(spec: JobSpec, given: str | None, base: bool = False) -> Path | None:
    """--checkpoint, or the newest committed checkpoint in training.checkpoint.dir; None for
    the model.init_from weights as imported (`base`, or no checkpoint committed yet): the
    baseline before training, which `parallelize` reads as it does to start a run."""
    from ctxlaunch.runtime.checkpointing import checkpoint

    if base:
        if given:
            raise ValueError("--base evaluates model.init_from as imported: drop --checkpoint")
        if spec.model.init_from is None:
            raise ValueError("--base evaluates model.init_from as imported, and it is not set")
        return None
    if given:
        path = Path(given)
        if not path.is_dir():
            raise ValueError(f"--checkpoint {given}: no such checkpoint directory")
        return path
    directory = spec.training.checkpoint.dir
    step = checkpoint.latest_step(directory)
    if directory is None or step is None:
        if spec.model.init_from is not None:
            return None
        raise ValueError(
            f"no checkpoint to evaluate: training.checkpoint.dir is {directory!r} "
            f"and holds no committed step; train first, pass --checkpoint, or set "
            f"model.init_from to evaluate a Hugging Face checkpoint as it is"
        )
    return checkpoint.step_dir(directory, step)
