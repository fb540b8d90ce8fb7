"""Resolve oneMKL VML's kernel dispatch on one thread before any op runs on several.

ATen computes contiguous float and double unary ops (cos, sin, exp, log, sqrt, tanh, erf, ...)
with MKL's VML, each intra-op thread calling it on its own chunk (aten/src/ATen/cpu/vml.h). The
oneMKL that torch 2.13's wheels bundle (2024.2) resolves each VML function's kernel lazily, on
its first call, and first calls made at once from several threads can run a low-accuracy kernel
for one thread's whole chunk of that one call: an error of up to thousands of ulp, silent, and
gone from the next call on (pytorch/pytorch#188792; it stops at oneMKL 2025.0, and
pytorch/pytorch#188791 proposes this same warm-up inside ATen). Here it showed as a CPU rank's
first RoPE table (`cos`, two threads per rank) differing from every other run's in a few runs
out of ten under load, so a job resumed from a checkpoint, whose first step is a process's first
call again, could end a few ulp away from the same job run straight through.

`warm_up` calls each of those ops once on a one-element tensor of each precision: below the
intra-op grain, so on the calling thread alone, and the dispatch is resolved before any
multi-threaded call. A few microseconds; a no-op where torch has no MKL.
"""

from __future__ import annotations

VML_OPS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)
"""The ops vml.h implements with MKL (IMPLEMENT_VML_MKL), float and double each."""


def warm_up() -> None:
    """Call every VML-backed op once, single-threaded (see the module's docstring)."""
    import torch

    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_OPS:
            getattr(torch, name)(x)
