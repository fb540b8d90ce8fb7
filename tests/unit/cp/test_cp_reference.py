"""Single-process pieces: full attention through the kernels, and the log-sum-exp merge."""

import pytest
import torch

from ctxlaunch.cp import full_attention
from ctxlaunch.cp.merge import MergeScratch, fused_merge, merge_block
from tests.helpers.attention import math_attention, reference_with_grads

FP32 = dict(rtol=1e-5, atol=1e-5)
# bf16 inputs against the float64 reference computed from the same (rounded) inputs.
BF16_OUT = dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads, scale", [(4, 4, None), (8, 2, 0.3)])
def test_full_attention_matches_math_fp32(causal, heads, kv_heads, scale):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 48, 16, generator=g)
    k, v = (torch.randn(2, kv_heads, 48, 16, generator=g) for _ in range(2))
    grad = torch.randn(2, heads, 48, 16, generator=g)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, grad, causal, scale)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = full_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    out.backward(grad)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (2, heads, 48)
    torch.testing.assert_close(out.double(), ref_out, **FP32)
    torch.testing.assert_close(lse.double(), ref_lse, **FP32)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        torch.testing.assert_close(got.double(), want, **FP32)


def test_full_attention_bf16_keeps_dtype_and_fp32_lse():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 32, 16, generator=g).bfloat16() for _ in range(3))
    out, lse = full_attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = math_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref_out, **BF16_OUT)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-3, atol=1e-3)


def test_bad_shapes_are_rejected():
    q = torch.randn(1, 6, 8, 4)
    with pytest.raises(
        ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"
    ):
        full_attention(q, torch.randn(1, 4, 8, 4), torch.randn(1, 4, 8, 4))
    with pytest.raises(ValueError, match="must be 4-D"):
        full_attention(q[0], q, q)


def test_merge_of_two_key_blocks_equals_attention_over_both():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(2))
    want_out, want_lse = math_attention(q, k, v, causal=False)
    out, lse = math_attention(q, k[:, :, :5], v[:, :, :5], causal=False)
    out, lse = out.float(), lse.float()
    block_out, block_lse = math_attention(q, k[:, :, 5:], v[:, :, 5:], causal=False)
    merge_block(out, lse, block_out, block_lse.float())
    torch.testing.assert_close(out.double(), want_out, **FP32)
    torch.testing.assert_close(lse.double(), want_lse, **FP32)


def test_merge_is_stable_for_far_apart_lse():
    out = torch.zeros(1, 1, 2, 3)
    lse = torch.tensor([[[-1000.0, 1000.0]]])
    merge_block(out, lse, torch.ones(1, 1, 2, 3), torch.tensor([[[1000.0, -1000.0]]]))
    torch.testing.assert_close(out, torch.tensor([[[[1.0] * 3, [0.0] * 3]]]))
    torch.testing.assert_close(lse, torch.tensor([[[1000.0, 1000.0]]]))


@pytest.mark.timeout(300)
def test_compiled_merge_equals_eager_on_half_row_views():
    """The merge CUDA runs (``fused_merge``: the math through torch.compile's Inductor, here its
    CPU backend) against the eager in-place form the CPU runs, on zigzag half-row views with a
    bf16 block and a reused scratch: equal within fp32 rounding, and only the viewed rows move."""
    g = torch.Generator().manual_seed(3)
    out, lse = torch.randn(2, 4, 16, 8, generator=g), torch.randn(2, 4, 16, generator=g) + 4
    block_out = torch.randn(2, 4, 8, 8, generator=g).bfloat16()
    block_lse = torch.randn(2, 4, 8, generator=g) + 4
    eager_out, eager_lse = out.clone(), lse.clone()
    scratch = MergeScratch(eager_out)
    merge_block(eager_out[:, :, 8:], eager_lse[:, :, 8:], block_out, block_lse, scratch)
    fused_merge()(out[:, :, 8:], lse[:, :, 8:], block_out, block_lse)
    torch.testing.assert_close(out, eager_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, eager_lse, rtol=1e-6, atol=1e-6)
    untouched = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(3))[:, :, :8]
    torch.testing.assert_close(out[:, :, :8], untouched, rtol=0, atol=0)
    assert not torch.equal(out[:, :, 8:], untouched)
