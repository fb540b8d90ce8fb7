"""The one-call-per-hop path for document masks (FlexAttention with a block mask, `cp/flex.py`,
what CUDA runs): the same outputs and gradients as the per-rectangle path, which stays the
reference; one attention call per ring hop where the per-rectangle path makes one per
rectangle, counted by the launch counting of `benchmarks/ring_counts.py`
(`devkit/launches.Counter`).

On the CPU FlexAttention's operators run torch's dense reference implementation (its fused
kernel is CUDA's): these tests check the calls, the block masks and the out/lse conventions
that path relies on, and Dynamo's capture of the two operators as CUDA compiles them (with the
aot_eager backend, which runs the captured graph on the CPU); the fused kernel's own numbers
remain to be checked on a GPU."""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

from ctxlaunch.cp import (
    flex,
    full_attention,
    hybrid_attention,
    kernels,
    new_hybrid_groups,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from devkit.launches import Counter
from tests.helpers.dist import run_distributed

TOL = dict(rtol=1e-10, atol=1e-10)


def many_documents(seq_len: int, seed: int) -> tuple[int, ...]:
    """A packed sequence of about seq_len / 6 documents of 1 to 11 tokens, and one long one."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0, seq_len // 3]
    while bounds[-1] < seq_len:
        bounds.append(min(seq_len, bounds[-1] + int(torch.randint(1, 12, (1,), generator=g))))
    return tuple(bounds)


def _run(method, local, groups, sharding, documents, grad):
    """Forward and backward of one CP attention; the results and the attention calls each made."""
    kwargs = dict(sharding=sharding, documents=documents, return_lse=True)
    local = [t.clone().requires_grad_() for t in local]
    forward, backward = Counter(), Counter()
    with forward:
        if method == "ring":
            out, lse = ring_attention(*local, None, **kwargs)
        elif method == "ulysses":
            out, lse = ulysses_attention(*local, None, **kwargs)
        else:
            out, lse = hybrid_attention(*local, *groups, **kwargs)
    with backward:
        out.backward(grad)
    result = (out.detach(), lse, *[t.grad for t in local])
    return result, forward.attention_calls, backward.attention_calls


def _check(rank, world_size):
    warnings.simplefilter("ignore")  # FlexAttention's notes about its CPU reference path
    groups = new_hybrid_groups(2) if world_size == 4 else None
    seq_len = 48 * world_size
    documents = [many_documents(seq_len, 1), (0, seq_len // 2, seq_len)]
    counts = {}
    for method in ["ring", "ulysses"] + (["hybrid"] if groups else []):
        for sharding in ("zigzag", "balanced"):
            name = f"{method} {sharding}"
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            kv_heads = world_size if method == "ulysses" else 2
            full = [
                torch.randn(2, h, seq_len, 8, generator=g, dtype=torch.float64)
                for h in (4, kv_heads, kv_heads, 4)
            ]
            local = [shard_sequence(t, None, 2, sharding, documents) for t in full]
            results = {}
            for kernel in ("rectangles", "flex"):
                kernels.use_masked_kernel(kernel)
                result, forward, backward = _run(
                    method, local[:3], groups, sharding, documents, local[3]
                )
                results[kernel] = result
                counts[(name, kernel)] = (len(forward), len(backward))
            kernels.use_masked_kernel("auto")
            for what, got, want in zip(
                ("out", "lse", "dq", "dk", "dv"), results["flex"], results["rectangles"]
            ):
                torch.testing.assert_close(got, want, **TOL, msg=f"{name}: {what}")
    return counts


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_call_per_hop_equals_the_rectangles(world_size):
    counts = run_distributed(_check, world_size, timeout_s=280)
    for name in {name for name, _ in counts[0]}:
        method = name.split()[0]
        ring = world_size if method == "ring" else (1 if method == "ulysses" else 2)
        for rank_counts in counts:
            forward, backward = rank_counts[(name, "flex")]
            # Forward: at most one call per hop; backward: one per hop and the own block's
            # second half (cut for overlap).
            assert 1 <= forward <= ring, (name, forward)
            assert 1 <= backward <= ring + 1, (name, backward)
        # The per-rectangle path makes one call per rectangle: many more.
        flex_calls = sum(sum(c[(name, "flex")]) for c in counts)
        rectangle_calls = sum(sum(c[(name, "rectangles")]) for c in counts)
        assert rectangle_calls > 3 * flex_calls, (name, rectangle_calls, flex_calls)


def test_whole_sequence_is_one_call_each_way():
    """Full attention over a packed sequence (CP 1, and Ulysses after its all-to-all): one
    FlexAttention call forward and one backward, at any number of documents, exact."""
    warnings.simplefilter("ignore")
    documents = [many_documents(96, 3), many_documents(96, 4)]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 96, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 96, 8, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn_like(q)
    results = {}
    try:
        for kernel in ("rectangles", "flex"):
            kernels.use_masked_kernel(kernel)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            counter = Counter()
            with counter:
                out, lse = full_attention(*inputs, return_lse=True, documents=documents)
                out.backward(grad)
            results[kernel] = (out, lse, *[t.grad for t in inputs])
            results[kernel + " calls"] = counter.attention_calls
    finally:
        kernels.use_masked_kernel("auto")
    assert results["flex calls"] == ["flex_attention", "flex_attention_backward"]
    assert len(results["rectangles calls"]) > 20
    for got, want in zip(results["flex"], results["rectangles"]):
        torch.testing.assert_close(got, want, **TOL)


def test_dynamo_captures_both_operators():
    """What CUDA compiles: Dynamo's capture of the forward and backward operators (run here by
    the aot_eager backend) gives the eager results, with the merged out/lse passed in."""
    warnings.simplefilter("ignore")
    documents = (many_documents(64, 5),)
    g = torch.Generator().manual_seed(1)
    q, grad = (torch.randn(1, 4, 64, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(2))
    mask = flex.MASKS.get(documents, None, 0, 0, (0, 64), q.device)
    options = flex._kernel_options(q)
    eager_out, eager_lse = flex._forward_op(q, k, v, mask.as_tuple(), 0.35, options)
    compiled = torch.compile(flex._forward_op, backend="aot_eager", fullgraph=True)
    out, lse = compiled(q, k, v, mask.as_tuple(), 0.35, options)
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(lse, eager_lse)
    eager = flex._backward_op(grad, q, k, v, out, lse, mask.as_tuple(), 0.35, options)
    compiled_backward = torch.compile(flex._backward_op, backend="aot_eager", fullgraph=True)
    for got, want in zip(
        compiled_backward(grad, q, k, v, out, lse, mask.as_tuple(), 0.35, options), eager
    ):
        torch.testing.assert_close(got, want)


def test_masks_are_built_once_per_batch():
    masks = flex.HopMasks(capacity=4)
    documents = (many_documents(64, 6),)
    first = masks.get(documents, None, 0, 0, (0, 64), torch.device("cpu"))
    assert masks.get(documents, None, 0, 0, (0, 64), torch.device("cpu")) is first
    assert masks.built == 1
    for seed in range(5):  # evicts the oldest past capacity
        masks.get((many_documents(64, 10 + seed),), None, 0, 0, (0, 64), torch.device("cpu"))
    masks.get(documents, None, 0, 0, (0, 64), torch.device("cpu"))
    assert masks.built == 7


def test_the_masked_kernel_choice():
    assert kernels.masked_kernel(torch.device("cpu")) == "rectangles"
    with pytest.raises(ValueError, match="expected auto or one of rectangles, flex"):
        kernels.use_masked_kernel("varlen")
