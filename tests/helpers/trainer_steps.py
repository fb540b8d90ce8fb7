"""One rank of the bundled trainer, stepped in-process: the losses and (rank 0's) full
gradients of the first step, and their comparison with one process's, for the exactness tests
that compare layouts with one process; and one rank's evaluation, for the tests that compare
evaluation across layouts."""

from __future__ import annotations

from pathlib import Path

import torch

from ctxlaunch.contract.loader import apply_overrides, validate_spec

EXACT_SPEC = {
    "name": "exact",
    "model": {"preset": "tiny", "dtype": "fp32"},
    "training": {
        "seq_len": 256,
        "micro_batch": 1,
        "global_batch": 2,
        "steps": 3,
        "seed": 7,
        "optimizer": {"lr": 1e-3, "warmup_steps": 1},
    },
    "parallel": {"cp": 1},
    "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
}
"""A tiny fp32 job the exactness tests vary: 256 tokens, global batch 2, three steps."""


def spec_for(world: int, **changes):
    """EXACT_SPEC on `world` CPU ranks with dotted-path changes, validated, as JSON data."""
    data = apply_overrides(
        EXACT_SPEC, [f"cluster.gpus_per_node={world}"] + [f"{k}={v}" for k, v in changes.items()]
    )
    return validate_spec(data).model_dump(mode="json")


def train_steps(rank: int, world: int, spec_data: dict, steps: int) -> dict:
    """Run `steps` training steps of the spec on this rank (inside `run_distributed`)."""
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    grads: list[dict[str, torch.Tensor]] = []
    metrics = [
        trainer.train_step(on_gradients=lambda e: grads.append(e.full_gradients()))
        for _ in range(steps)
    ]
    # numpy, not tensors: torch would pass tensors through shared memory that vanishes with
    # the worker process.
    return {
        "losses": [m.loss for m in metrics],
        "attention_balance": [m.attention_balance for m in metrics],
        "aux_losses": [m.aux_loss for m in metrics],
        "grads": {k: v.numpy() for k, v in grads[0].items()} if rank == 0 else None,
    }


def evaluate_rank(rank: int, world: int, spec_data: dict, path: str | None = None) -> dict:
    """One rank's evaluation at the spec's layout: of the checkpoint at `path`, else of the
    weights the trainer starts from (the spec's init_from, or the seeded initial weights, the
    same at every layout)."""
    from ctxlaunch.runtime.evaluation.eval_weights import load_weights
    from ctxlaunch.runtime.evaluation.evaluator import Evaluator
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.parallel.parallelize import parallelize_job

    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    with torch.device("meta"):
        model = Transformer.from_spec(spec.model)
    parts = parallelize_job(model, spec, ctx=ctx, device=torch.device("cpu"))
    if path is not None:
        load_weights(parts, spec, ctx, torch.device("cpu"), Path(path))
    return Evaluator(spec, ctx, parts.model, torch.device("cpu")).run().to_dict()


def assert_matches_one_process(got: dict, want: dict, what: str = "") -> tuple[float, float]:
    """Assert a run's losses (rtol 1e-5) and first-step gradients (rtol 1e-4, atol 1e-6) equal
    the reference's (`train_steps`' results); returns the largest gradient difference, absolute
    and relative to the largest entry of that gradient."""
    where = f"{what}: " if what else ""
    torch.testing.assert_close(
        torch.tensor(got["losses"]),
        torch.tensor(want["losses"]),
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"{where}losses: {m}",
    )
    assert set(got["grads"]) == set(want["grads"]), where
    worst_abs = worst_rel = 0.0
    for name, grad in want["grads"].items():
        a, b = torch.from_numpy(got["grads"][name]), torch.from_numpy(grad)
        torch.testing.assert_close(
            a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{where}gradient of {n}: {m}"
        )
        diff = float((a - b).abs().max())
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / float(b.abs().max().clamp_min(1e-12)))
    return worst_abs, worst_rel
