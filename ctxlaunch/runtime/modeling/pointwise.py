"""The pointwise work of every block as autograd Functions that save only what the planner
counts: RMSNorm (its input and the fp32 reciprocal RMS), SwiGLU and GeGLU (gate and up,
recomputing the activation in backward), each backward in fp32 over chunks of
BACKWARD_CHUNK_TOKENS tokens; and the same math compiled by inductor where
`training.compile` asks (`set_compiled`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ctxlaunch.perf.memory import BACKWARD_CHUNK_TOKENS


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or as it is if wider (float64, for exactness checks)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _row_chunks(rows: int) -> Iterator[slice]:
    """Token rows in chunks of BACKWARD_CHUNK_TOKENS: the fp32 temporaries of the pointwise
    backward passes below exist for one chunk at a time."""
    for start in range(0, rows, BACKWARD_CHUNK_TOKENS):
        yield slice(start, start + BACKWARD_CHUNK_TOKENS)


# -- compiled pointwise math (training.compile) -----------------------------------------------
# Each function below is the whole pointwise body of one step of RMSNorm, SwiGLU or RoPE, so
# that inductor fuses it into one kernel (no fp32 temporaries in memory). The autograd
# Functions keep what they save and their token chunks: compiling changes only how one chunk
# is computed, so the planner's constants still hold (its count of the eager backward's fp32
# temporaries becomes an upper bound). Attention and the matmuls are never compiled.
def _rms_forward_math(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = _upcast(x)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * _upcast(weight)).to(x.dtype), rstd


def _rms_backward_math(
    x: torch.Tensor, grad_y: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x in x's dtype, the gain's gradient summed over these rows, fp32) of rows."""
    normed = _upcast(x) * rstd
    g32 = _upcast(grad_y)
    gw = g32 * _upcast(weight)
    mean = (gw * normed).mean(-1, keepdim=True)
    return ((gw - normed * mean) * rstd).to(x.dtype), (g32 * normed).sum(0)


def _swiglu_forward_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu_backward_math(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of rows, computed in fp32, in the inputs' dtype."""
    g32, dy32 = _upcast(gate), _upcast(dy)
    sig = torch.sigmoid(g32)
    grad_up = g32 * sig * dy32
    grad_gate = sig * (1 + g32 * (1 - sig)) * dy32 * _upcast(up)
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def _geglu_forward_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def _geglu_backward_math(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of rows, computed in fp32, in the inputs' dtype."""
    g32, dy32 = _upcast(gate), _upcast(dy)
    grad_up = F.gelu(g32, approximate="tanh") * dy32
    grad_gate = torch.ops.aten.gelu_backward(dy32 * _upcast(up), g32, approximate="tanh")
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def _apply_rope_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


_EAGER_POINTWISE: dict[str, Callable[..., Any]] = {
    "rms_forward": _rms_forward_math,
    "rms_backward": _rms_backward_math,
    "swiglu_forward": _swiglu_forward_math,
    "swiglu_backward": _swiglu_backward_math,
    "geglu_forward": _geglu_forward_math,
    "geglu_backward": _geglu_backward_math,
    "rope": _apply_rope_math,
}
_compiled_pointwise: dict[str, Callable[..., Any]] = {}
_POINTWISE: dict[str, Callable[..., Any]] | None = None
"""The compiled kernels while `set_compiled(True)` holds, else None (the eager code below)."""


def set_compiled(enabled: bool) -> None:
    """Run the pointwise work of every block through torch.compile (`enabled`) or eagerly.
    Process-wide: the autograd Functions are static. Each function is compiled once per input
    shape and dtype, on first use (fullgraph; attention stays outside every compiled region)."""
    global _POINTWISE
    if enabled and not _compiled_pointwise:
        for name, fn in _EAGER_POINTWISE.items():
            _compiled_pointwise[name] = torch.compile(fn, fullgraph=True, dynamic=False)
    _POINTWISE = _compiled_pointwise if enabled else None


def _pointwise(name: str) -> Callable[..., Any]:
    return (_POINTWISE or _EAGER_POINTWISE)[name]


def compiled() -> bool:
    """Whether the pointwise work runs compiled (`set_compiled`)."""
    return _POINTWISE is not None


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w, in fp32 inside; saves x and the fp32 1/rms only. Backward computes
    in fp32 over chunks of tokens, so its fp32 temporaries are (chunk x h), not (tokens x h)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _pointwise("rms_forward")(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, g2, rstd2 = x.reshape(-1, h), grad_y.reshape(-1, h), rstd.reshape(-1, 1)
        grad_x = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        grad_weight = torch.zeros(h, dtype=rstd.dtype, device=x.device)
        kernel = None if _POINTWISE is None else _POINTWISE["rms_backward"]
        w32 = _upcast(weight)
        for rows in _row_chunks(x2.shape[0]):
            if kernel is not None:
                grad_x[rows], gw_rows = kernel(x2[rows], g2[rows], rstd2[rows], weight)
                grad_weight += gw_rows
                continue
            r = rstd2[rows]
            normed = _upcast(x2[rows]) * r
            g32 = _upcast(g2[rows])
            gw = g32 * normed
            grad_weight += gw.sum(0)
            torch.mul(g32, w32, out=gw)
            # d/dx of x * rstd: rstd * (gw - normed * mean(gw * normed))
            mean = (gw * normed).mean(-1, keepdim=True)
            grad_x[rows] = gw.sub_(normed.mul_(mean)).mul_(r)
            del normed, g32, gw, mean  # before the next chunk's, not after
        return grad_x.view(x.shape), grad_weight.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        """The gain is stored as w and applied as 1 + w (in fp32, as transformers' Gemma)."""
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + 1.0 if self.offset else self.weight
        # Under autocast the norm runs in the input's dtype (fp32 residual), as the planner counts.
        with torch.autocast(device_type=x.device.type, enabled=False):
            return _RMSNorm.apply(x, weight, self.eps)


def gated_backward(
    gate: torch.Tensor,
    up: torch.Tensor,
    grad: torch.Tensor,
    rows_backward: Callable[..., None],
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of a gated activation, chunk by chunk of BACKWARD_CHUNK_TOKENS
    rows, so that its fp32 temporaries are one chunk's: `rows_backward(gate, up, grad,
    grad_gate_out, grad_up_out)` writes a chunk's gradients into the two outputs (eagerly), or
    `kernel(gate, up, grad)` returns them (compiled)."""
    f = gate.shape[-1]
    gate2, up2, grad2 = gate.reshape(-1, f), up.reshape(-1, f), grad.reshape(-1, f)
    grad_gate = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    grad_up = torch.empty(up2.shape, dtype=up.dtype, device=up.device)
    for rows in _row_chunks(gate2.shape[0]):
        if kernel is not None:
            grad_gate[rows], grad_up[rows] = kernel(gate2[rows], up2[rows], grad2[rows])
        else:
            rows_backward(gate2[rows], up2[rows], grad2[rows], grad_gate[rows], grad_up[rows])
    return grad_gate.view(gate.shape), grad_up.view(up.shape)


def _swiglu_rows_backward(
    gate: torch.Tensor,
    up: torch.Tensor,
    grad: torch.Tensor,
    grad_gate: torch.Tensor,
    grad_up: torch.Tensor,
) -> None:
    g32 = _upcast(gate)
    sig = torch.sigmoid(g32)
    dy = _upcast(grad)
    work = torch.mul(g32, sig)  # silu
    grad_up.copy_(work.mul_(dy))
    # d silu / d gate = sig * (1 + gate * (1 - sig))
    work.fill_(1).sub_(sig).mul_(g32).add_(1).mul_(sig)
    del g32, sig  # an in-place op with a 16-bit operand would upcast it into a new
    # temporary: upcast up explicitly, once these two are gone
    grad_gate.copy_(work.mul_(dy).mul_(_upcast(up)))


def _geglu_rows_backward(
    gate: torch.Tensor,
    up: torch.Tensor,
    grad: torch.Tensor,
    grad_gate: torch.Tensor,
    grad_up: torch.Tensor,
) -> None:
    g32, dy = _upcast(gate), _upcast(grad)
    work = F.gelu(g32, approximate="tanh")
    grad_up.copy_(work.mul_(dy))
    # Two (chunk x ffn) fp32 temporaries at most, as SwiGLU's backward (four in 16-bit with the
    # upcasts of gate and the gradient, gone before up's arrives).
    slope = torch.ops.aten.gelu_backward(dy, g32, approximate="tanh")
    del work, g32, dy
    grad_gate.copy_(slope.mul_(_upcast(up)))


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up; saves gate and up, recomputes the SiLU in backward. Backward computes
    in fp32 over chunks of tokens, in place, so its fp32 temporaries are two (chunk x ffn)
    tensors (four in 16-bit, with the upcasts of gate and grad), not eight (tokens x ffn)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _pointwise("swiglu_forward")(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        kernel = None if _POINTWISE is None else _POINTWISE["swiglu_backward"]
        return gated_backward(gate, up, grad, _swiglu_rows_backward, kernel)


class _GeGLU(torch.autograd.Function):
    """gelu_tanh(gate) * up (GELU's tanh approximation); saves gate and up, recomputes the GELU
    in backward, in fp32 over chunks of tokens as `_SwiGLU` does."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _pointwise("geglu_forward")(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        kernel = None if _POINTWISE is None else _POINTWISE["geglu_backward"]
        return gated_backward(gate, up, grad, _geglu_rows_backward, kernel)


GATED: dict[str, type[torch.autograd.Function]] = {"silu": _SwiGLU, "gelu_tanh": _GeGLU}
"""The feed-forward's gated activation, by the family's name for it."""
