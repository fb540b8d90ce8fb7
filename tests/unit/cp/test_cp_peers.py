"""Peer parity: our ring equals PyTorch's _templated_ring_attention, our Ulysses equals DeepSpeed's
DistributedAttention, on the same shards, forward and backward (gloo worker processes)."""

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ctxlaunch.cp import ring_attention, shard_sequence, ulysses_attention
from tests.helpers.dist import run_distributed

TIGHT = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-2)


def _inputs(seed, b, hq, hkv, seq_len, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, seq_len, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, seq_len, d, generator=g).to(dtype) for _ in range(2))
    grad = torch.randn(b, hq, seq_len, d, generator=g).to(dtype)
    return q, k, v, grad


def _check_torch_ring(rank, world_size):
    from torch.distributed.tensor.experimental._attention import (
        _cp_options,
        _templated_ring_attention,
    )
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    aten = torch.ops.aten
    # PyTorch's load balancing is head-tail sharding, which is our zigzag; without it, contiguous.
    cases = [("contiguous", True, False), ("contiguous", False, False), ("zigzag", True, True)]
    for seed, (sharding, causal, load_balance) in enumerate(cases):
        name = f"torch ring N={world_size} {sharding} causal={causal}"
        _cp_options.enable_load_balance = load_balance
        full = _inputs(seed, 2, 4, 4, 32 * world_size, 16, torch.float32)
        q, k, v, grad = (shard_sequence(t, None, 2, sharding) for t in full)
        scale = 0.25
        theirs_out, theirs_lse = _templated_ring_attention(
            dist.group.WORLD,
            2,
            aten._scaled_dot_product_flash_attention_for_cpu,
            q,
            k,
            v,
            is_causal=causal,
            dropout_p=0.0,
            scale=scale,
        )[:2]
        theirs_grads = _templated_ring_attention_backward(
            dist.group.WORLD,
            2,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad,
            grad_out_name="grad_out",
            query=q,
            key=k,
            value=v,
            out=theirs_out,
            logsumexp=theirs_lse,
            is_causal=causal,
            dropout_p=0.0,
            scale=scale,
        )[:3]
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ring_attention(
            *local, None, causal=causal, sharding=sharding, scale=scale, return_lse=True
        )
        out.backward(grad)
        torch.testing.assert_close(out, theirs_out, **TIGHT, msg=lambda m: f"{name}: out\n{m}")
        torch.testing.assert_close(lse, theirs_lse, **TIGHT, msg=lambda m: f"{name}: lse\n{m}")
        for label, t, want in zip("qkv", local, theirs_grads):
            torch.testing.assert_close(
                t.grad, want, **TIGHT, msg=lambda m: f"{name}: d{label}\n{m}"
            )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_equals_torch_templated_ring_attention(world_size):
    run_distributed(_check_torch_ring, world_size)


def _sdpa_bshd(q, k, v, causal, scale):
    """DeepSpeed's inner attention: [b, s, h, d] in and out."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _check_deepspeed_ulysses(rank, world_size):
    # Skip DeepSpeed's 75 s shared-memory op build; the module must be patched by this path.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")
    ds_attention = DistributedAttention(_sdpa_bshd, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    # DeepSpeed attends over shards in rank order, which is token order only for the contiguous
    # sharding; without a causal mask the key order does not matter, so zigzag is compared too.
    cases = [
        ("contiguous", True, torch.float32),
        ("contiguous", False, torch.float32),
        ("zigzag", False, torch.float32),
        ("contiguous", True, torch.bfloat16),
    ]
    for seed, (sharding, causal, dtype) in enumerate(cases):
        name = f"deepspeed ulysses N={world_size} {sharding} causal={causal} {dtype}"
        full = _inputs(seed, 2, 8, world_size, 16 * world_size, 16, dtype)
        q, k, v, grad = (shard_sequence(t, None, 2, sharding) for t in full)
        scale = 0.3
        # DeepSpeed's sharding is [b, s/p, h, d].
        ds_in = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        ds_out = ds_attention(*ds_in, 0, None, causal, scale)
        ds_out.backward(grad.transpose(1, 2))
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*local, None, causal=causal, sharding=sharding, scale=scale)
        out.backward(grad)
        tol = TIGHT if dtype == torch.float32 else BF16
        torch.testing.assert_close(
            out, ds_out.transpose(1, 2), **tol, msg=lambda m: f"{name}: out\n{m}"
        )
        for label, t, want in zip("qkv", local, ds_in):
            want = want.grad.transpose(1, 2)
            torch.testing.assert_close(t.grad, want, **tol, msg=lambda m: f"{name}: d{label}\n{m}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_equals_deepspeed_distributed_attention(world_size):
    pytest.importorskip("deepspeed")
    run_distributed(_check_deepspeed_ulysses, world_size)
