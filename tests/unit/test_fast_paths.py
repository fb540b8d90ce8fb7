"""The trainer's fast paths on the CPU: fused AdamW against foreach, each switch's resolution
and the spec's check of it. One process, the real tiny model and the real trainer step."""

from __future__ import annotations

import pytest
import torch

from ctxlaunch.contract.loader import apply_overrides, validate_spec
from ctxlaunch.runtime.trainer import fastpath

BASE = {
    "name": "fast",
    "model": {"preset": "tiny", "dtype": "fp32"},
    "training": {
        "seq_len": 128,
        "micro_batch": 1,
        "global_batch": 1,
        "steps": 3,
        "seed": 3,
        "optimizer": {"lr": 3e-3, "warmup_steps": 1, "weight_decay": 0.1},
    },
    "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
}


def _trainer(*overrides: str):
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(apply_overrides(BASE, list(overrides)))
    ctx = build_context(spec.parallel_dims, rank=0)
    return Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)


def test_switches_resolve_auto_by_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert fastpath.resolve("auto", cpu) is False
    assert fastpath.resolve("auto", cuda) is True
    assert fastpath.resolve(True, cpu) is True
    assert fastpath.resolve(False, cuda) is False


@pytest.mark.parametrize("field", ["compile", "fused_optimizer"])
def test_spec_rejects_a_bad_switch(field: str) -> None:
    with pytest.raises(Exception, match=field):
        validate_spec(apply_overrides(BASE, [f"training.{field}=sometimes"]))


def test_fused_adamw_matches_foreach() -> None:
    """Three real steps of the tiny model with AdamW fused (torch fuses on the CPU too) and
    with foreach: the same losses and weights within fp32 rounding, and the optimizer asked
    for is the one that ran."""
    runs = {}
    for fused in (True, False):
        trainer = _trainer(f"training.fused_optimizer={str(fused).lower()}")
        group = trainer.engine.optimizer.param_groups[0]
        assert bool(group["fused"]) is fused and bool(group["foreach"]) is not fused
        losses = [trainer.train_step().loss for _ in range(3)]
        weights = {name: p.detach().clone() for name, p in trainer.engine.named_parameters()}
        runs[fused] = losses, weights
    (fused_losses, fused_weights), (foreach_losses, foreach_weights) = runs[True], runs[False]
    assert fused_losses == pytest.approx(foreach_losses, rel=1e-5)
    assert fused_losses[2] != pytest.approx(fused_losses[0], rel=1e-3)  # it did train
    # Adam's update is about lr per element whatever the gradient's size, so where the second
    # moment is tiny the two kernels' fp32 rounding of m / (sqrt(v) + eps) shows at 1e-4 of
    # lr; a wrong update (a missed bias correction, weight decay, step) is off by lr itself.
    lr = BASE["training"]["optimizer"]["lr"]
    for name, weight in fused_weights.items():
        torch.testing.assert_close(
            weight,
            foreach_weights[name],
            rtol=1e-5,
            atol=1e-3 * lr,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def _loss_and_grads(model, tokens, positions, targets):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, targets)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_compiled_pointwise_matches_eager() -> None:
    """training.compile: the tiny model's loss and every gradient with RMSNorm, RoPE and
    SwiGLU (forward and their hand-written backward math) through torch.compile on the CPU
    (inductor, real C++ kernels) equal eager within fp32 rounding, at every checkpointing
    mode (the compiled kernels inside recomputation too)."""
    from ctxlaunch.runtime.modeling import pointwise
    from ctxlaunch.runtime.modeling.model import Transformer

    torch.manual_seed(0)
    model = Transformer(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn_hidden=160,
        vocab=96,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    )
    model.init_weights(seed=1)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 96, (1, 96), generator=generator)
    targets = torch.randint(0, 96, (1, 96), generator=generator)
    positions = torch.arange(96)
    try:
        for mode in ("none", "full"):
            model.set_checkpointing(mode)
            pointwise.set_compiled(False)
            eager_loss, eager_grads = _loss_and_grads(model, tokens, positions, targets)
            pointwise.set_compiled(True)
            assert pointwise.compiled()
            loss, grads = _loss_and_grads(model, tokens, positions, targets)
            torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
            assert grads.keys() == eager_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad,
                    eager_grads[name],
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, n=name: f"{mode} {n}: {m}",
                )
    finally:
        pointwise.set_compiled(False)
    # The compiled path did run: dynamo captured a graph for each of the five pointwise
    # functions (more for RoPE's q and k shapes and the partial shapes), with no graph break.
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= len(pointwise._EAGER_POINTWISE), dict(
        counters["stats"]
    )
    assert not counters["graph_break"], dict(counters["graph_break"])
