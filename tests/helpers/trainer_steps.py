"""One rank of the bundled trainer, stepped in-process: the losses and (rank 0's) full
gradients of the first step, for the exactness tests that compare layouts with one process."""

from __future__ import annotations

import torch

from ctxlaunch.contract.loader import validate_spec


def train_steps(rank: int, world: int, spec_data: dict, steps: int) -> dict:
    """Run `steps` training steps of the spec on this rank (inside `run_distributed`)."""
    from ctxlaunch.runtime.trainer.loop import Trainer
    from ctxlaunch.runtime.trainer.parallelize import build_context

    spec = validate_spec(spec_data)
    p = spec.parallel
    ctx = build_context(
        rank=rank,
        world_size=world,
        dp=spec.dp,
        cp=p.cp,
        ulysses=spec.ulysses_degree,
        cp_sharding=p.cp_sharding,
        tp=p.tp,
        pp=p.pp,
    )
    trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    grads: list[dict[str, torch.Tensor]] = []
    losses = [
        trainer.train_step(on_gradients=lambda e: grads.append(e.full_gradients())).loss
        for _ in range(steps)
    ]
    # numpy, not tensors: torch would pass tensors through shared memory that vanishes with
    # the worker process.
    return {
        "losses": losses,
        "grads": {k: v.numpy() for k, v in grads[0].items()} if rank == 0 else None,
    }
