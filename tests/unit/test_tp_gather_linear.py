"""`gather_linear` (the sequence all-gather fused with a column-parallel projection, keeping
only the local shard for backward) against the separate gather_sequence and linear it replaced:
output and gradients at TP 2, fp32 and under bf16 autocast, and what it saves for backward."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed


def _rank(rank: int, world: int, autocast: bool) -> dict[str, object]:
    import torch.distributed as dist
    from torch import nn

    from ctxlaunch.runtime.parallel.tensor_parallel import gather_linear, gather_sequence
    from devkit.memtrace import SavedTensorMeter

    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(11)
    x_full = torch.randn(2, 64, 32, generator=generator)  # (B, S, h)
    linear = nn.Linear(32, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 32, generator=generator) * 0.1)
    grad_out = torch.randn(2, 64, 48, generator=generator)
    local = x_full.chunk(world, dim=1)[rank]
    results = {}
    for name, fn in (
        ("fused", lambda x: gather_linear(x, linear, group)),
        ("separate", lambda x: linear(gather_sequence(x, group))),
    ):
        x = local.clone().requires_grad_()
        linear.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with SavedTensorMeter(exclude=linear.parameters()) as meter:
                out = fn(x)
        out.backward(grad_out.to(out.dtype))
        assert x.grad is not None and linear.weight.grad is not None
        # numpy, not tensors: tensors would pass through shared memory that vanishes with the
        # worker process.
        results[name] = (
            out.detach().float().numpy(),
            x.grad.float().numpy(),
            linear.weight.grad.float().numpy(),
            str(x.grad.dtype),
            str(linear.weight.grad.dtype),
            meter.bytes,
        )
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("autocast", [False, True])
def test_gather_linear_matches_gather_then_linear_at_tp2(autocast: bool) -> None:
    for result in run_distributed(_rank, 2, autocast, timeout_s=150):
        assert isinstance(result, dict)
        fused, separate = result["fused"], result["separate"]
        assert fused[3:5] == separate[3:5] == ("torch.float32", "torch.float32")
        for name, f, s in zip(("out", "d x", "d weight"), fused[:3], separate[:3], strict=True):
            torch.testing.assert_close(
                torch.from_numpy(f), torch.from_numpy(s), rtol=0, atol=0, msg=name
            )
        # What each keeps for backward: the local (B, S/2, h) shard in the compute dtype (and
        # autocast's bf16 weight copy) instead of the gathered (B, S, h) input.
        a = 2 if autocast else 4
        weight_copy = 2 * 48 * 32 if autocast else 0
        assert fused[5] == a * 2 * 32 * 32 + weight_copy
        assert separate[5] == a * 2 * 64 * 32 + weight_copy
