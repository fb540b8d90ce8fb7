"""The attention kernel a run uses, chosen by measurement on the GPU at hand.

On CUDA with 16-bit inputs torch offers more than one kernel that returns the log-sum-exp the
CP merges need: its bundled FlashAttention-2, cuDNN's fused attention, and FlashAttention-3
where the `flash_attn_interface` package is installed on a Hopper GPU. Which is fastest depends
on the GPU, the head dimension and the block length, so `choose` times each candidate's
forward and backward at the run's own block shape, keeps only those whose out, lse and
gradients agree with the first candidate's (FlashAttention-2), and makes the fastest the one
`kernels` calls. On the CPU there is one kernel and nothing to measure.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import kernels

ENV = "CTXLAUNCH_ATTENTION_KERNEL"
"""auto (measure), or a kernel of kernels.CUDA_KERNELS to use without measuring."""

# bf16 keeps 8 bits of mantissa: two correct kernels differ by a few units in the last place of
# values of order one (out, dq/dk/dv of unit-variance inputs); lse is fp32 in every kernel.
AGREEMENT = {"out": 2e-2, "lse": 1e-3, "grad": 5e-2}


@dataclass(frozen=True)
class KernelChoice:
    kernel: str
    chosen_by: str
    """"measured", "forced" (CTXLAUNCH_ATTENTION_KERNEL), or "only" (one kernel fits)."""
    shape: tuple[int, ...] = ()
    """(batch, query heads, K/V heads, block length, head dim) the candidates were timed at."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Median forward + backward time of each candidate that ran and agreed."""
    refused: dict[str, str] = field(default_factory=dict)
    """Why each other candidate was not used."""

    def describe(self) -> str:
        """The account of the choice for the run's first lines."""
        if self.chosen_by != "measured":
            return f"{self.kernel} ({self.chosen_by})"
        timed = ", ".join(
            f"{name} {s * 1e3:.3f} ms"
            for name, s in sorted(self.seconds.items(), key=lambda item: item[1])
        )
        refused = "".join(f"; {name} not used: {why}" for name, why in self.refused.items())
        b, hq, hkv, s, d = self.shape
        return (
            f"{self.kernel} (fastest fwd+bwd at {b}x{hq}/{hkv} heads x {s} x {d}: {timed}{refused})"
        )


def choose(
    batch: int,
    heads: int,
    kv_heads: int,
    block: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    causal: bool = True,
    repeats: int = 10,
    candidates: Sequence[str] = kernels.CUDA_KERNELS,
    measure_on_cpu: bool = False,
) -> KernelChoice:
    """The kernel for attention calls of this shape, made the one `kernels` calls.

    `measure_on_cpu` runs the measurement on the CPU too, where every candidate runs the same
    CPU kernel: only the tests use it, to exercise the measuring and the refusals."""
    forced = os.environ.get(ENV, "auto")
    if forced != "auto":
        kernels.use_cuda_kernel(forced)  # raises, naming the choices, for a bad name
        return KernelChoice(forced, "forced")
    if device.type != "cuda" and not measure_on_cpu:
        return KernelChoice("cpu flash", "only")
    shape = (batch, heads, kv_heads, block, head_dim)
    if dtype not in (torch.float16, torch.bfloat16):
        return KernelChoice("memory-efficient", "only", shape)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(h: int) -> torch.Tensor:
        return torch.randn(
            batch, h, block, head_dim, generator=generator, device=device, dtype=dtype
        )

    q, k, v, grad = randn(heads), randn(kv_heads), randn(kv_heads), randn(heads)
    scale = kernels.resolve_scale(q, None)

    def step() -> tuple[torch.Tensor, ...]:
        out, lse = kernels.attention_forward(q, k, v, causal, scale)
        return (out, lse, *kernels.attention_backward(grad, q, k, v, out, lse, causal, scale))

    seconds: dict[str, float] = {}
    refused: dict[str, str] = {}
    reference: tuple[torch.Tensor, ...] | None = None
    for name in candidates:
        try:
            kernels.use_cuda_kernel(name)
            result = step()
            if reference is None:
                reference = result
            else:
                disagreement = _disagreement(result, reference, candidates[0])
                if disagreement:
                    refused[name] = disagreement
                    continue
            seconds[name] = _median_seconds(step, device, repeats)
        except Exception as exc:  # a kernel this torch or GPU cannot run is not a choice
            refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if not seconds:
        kernels.use_cuda_kernel("flash")
        return KernelChoice("flash", "only", shape, {}, refused)
    fastest = min(seconds, key=seconds.__getitem__)
    kernels.use_cuda_kernel(fastest)
    return KernelChoice(fastest, "measured", shape, seconds, refused)


def _disagreement(
    result: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], reference_name: str
) -> str:
    """'' where `result` (out, lse, dq, dk, dv) agrees with `reference` (from kernel
    `reference_name`), else what differs."""
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, want in zip(names, result, reference, strict=True):
        if got.shape != want.shape:
            return f"{name} has shape {tuple(got.shape)}, {reference_name}'s {tuple(want.shape)}"
        tolerance = AGREEMENT.get(name, AGREEMENT["grad"])
        error = (got.float() - want.float()).abs().max().item()
        scale = max(want.float().abs().max().item(), 1.0)
        if not error <= tolerance * scale:  # also catches NaN
            return f"{name} differs from {reference_name}'s by {error:.3g}"
    return ""


def _median_seconds(step: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of `step` over `repeats` runs after two warm-ups: CUDA events on the GPU
    (no host synchronisation inside a run), the host clock on the CPU."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)
