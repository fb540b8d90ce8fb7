"""The trainer's hand-written RMSNorm and SwiGLU backward passes (chunked over tokens, in place)
against autograd of the plain formulas: in float64 exactly, in fp32 and bf16 to their rounding;
and what their backward allocates at once, from the allocator's record."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxlaunch.perf.memory import BACKWARD_CHUNK_TOKENS
from ctxlaunch.runtime.modeling.pointwise import _RMSNorm, _SwiGLU
from devkit.memtrace import AllocatorTrace

# A token count that is not a multiple of the chunk, so the last chunk is partial.
TOKENS = 2 * BACKWARD_CHUNK_TOKENS + 77
TOLERANCE = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}


def _swiglu_inputs(dtype: torch.dtype, ffn: int = 96) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    # gate and up as the model makes them: the two halves of one projection (strided views).
    gate_up = (torch.randn(2, TOKENS // 2, 2 * ffn, generator=generator) * 3).to(dtype)
    grad = torch.randn(2, TOKENS // 2, ffn, generator=generator).to(dtype)
    return gate_up, grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_swiglu_backward_matches_autograd(dtype: torch.dtype) -> None:
    gate_up, grad = _swiglu_inputs(dtype)
    mine = gate_up.clone().requires_grad_()
    gate, up = mine.chunk(2, dim=-1)
    _SwiGLU.apply(gate, up).backward(grad)
    # The reference: autograd of the formula in float64, rounded once to the dtype.
    ref = gate_up.double().requires_grad_()
    ref_gate, ref_up = ref.chunk(2, dim=-1)
    (F.silu(ref_gate) * ref_up).backward(grad.double())
    assert mine.grad is not None and ref.grad is not None
    assert mine.grad.dtype == dtype
    torch.testing.assert_close(mine.grad, ref.grad.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rmsnorm_backward_matches_autograd(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    h = 64
    x = torch.randn(2, TOKENS // 2, h, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(h, generator=generator)).to(dtype)
    grad = torch.randn(2, TOKENS // 2, h, generator=generator).to(dtype)
    mine_x, mine_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    _RMSNorm.apply(mine_x, mine_w, 1e-5).backward(grad)
    ref_x, ref_w = x.double().requires_grad_(), weight.double().requires_grad_()
    y = ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + 1e-5) * ref_w
    y.backward(grad.double())
    assert mine_x.grad is not None and mine_w.grad is not None
    assert ref_x.grad is not None and ref_w.grad is not None
    torch.testing.assert_close(mine_x.grad, ref_x.grad.to(dtype), **TOLERANCE[dtype])
    # The gain's gradient sums over every token: its bf16 rounding is of a larger number.
    tol = TOLERANCE[dtype] if dtype != torch.bfloat16 else {"rtol": 1.6e-2, "atol": 0.5}
    torch.testing.assert_close(mine_w.grad, ref_w.grad.to(dtype), **tol)


@pytest.mark.parametrize("dtype, fp32_temporaries", [(torch.float32, 2), (torch.bfloat16, 4)])
def test_swiglu_backward_transient_is_one_chunk(dtype: torch.dtype, fp32_temporaries: int) -> None:
    """Beyond its two outputs, SwiGLU's backward holds `fp32_temporaries` fp32 (chunk x ffn)
    tensors at once (the planner's constant), whatever the number of tokens."""
    ffn = 96
    gate_up, grad = _swiglu_inputs(dtype, ffn)
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = _SwiGLU.apply(gate, up)
    with AllocatorTrace() as trace:
        out.backward(grad)
    outputs = 2 * gate.numel() * gate.element_size()
    temporaries = trace.peak_bytes - outputs
    # (a few bytes of autograd's own bookkeeping on top)
    assert 0 <= temporaries - fp32_temporaries * 4 * BACKWARD_CHUNK_TOKENS * ffn < 64, temporaries
