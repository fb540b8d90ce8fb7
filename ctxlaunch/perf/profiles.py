"""Framework profiles: whose kernels and overlap the step-time model times, each constant named
with its source; and the shape-level physics both use (a GEMM's efficiency from its shape, an
attention call's from its length, head dimension and kernel generation).

The constants fitted from measurements live in data files beside this module (fitted/*.json),
each with what it holds, the machine and command that measured it, the date and the values;
`fitted_values` reads each once.

Two profiles:

- ``ctxlaunch`` (the default): the bundled trainer, eager PyTorch under bf16 autocast, the
  attention kernel it picks by measurement (cuDNN's on the H200), no fused elementwise
  kernels, gradient collectives after the last backward (not overlapped). Where no
  calibration of the user's own GPUs is given, its constants are one calibration of an H200
  by the calibration job's own code (fitted/ctxlaunch-h200.json): the projections' GEMM
  efficiency, the attention kernel's rate and length ramp, the blocks' elementwise rate, the
  loss's rate and the fixed cost per micro-batch. Seven trainer layouts that calibration never
  ran are its held-out check.
- ``megatron``: Megatron-LM/NeMo (Transformer Engine's fused kernels, the FP8 delayed-scaling
  recipe, the distributed optimizer's gradient reduce-scatter and weight all-gather overlapped
  with compute). Its two matmul efficiencies are fitted on the published runs' fit subset
  (fitted/megatron-published.json); its attention is the same flash kernel's measured rate
  (fitted/flash-attention-h200.json), not fitted: the published Hopper runs (NeMo 24.03,
  Llama 3) ran FlashAttention-2-generation kernels, whose exponentials are exposed (they came
  before FlashAttention-3); where the GPU table has no SFU rate (B200) none is charged.

Both share the large-GEMM efficiency's meaning: the fraction of the tensor-core peak a large,
well-shaped GEMM reaches; each GEMM of the step then loses what its shape costs
(`gemm_seconds`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

FrameworkName = Literal["ctxlaunch", "megatron"]

FITTED_DIR = Path(__file__).resolve().parent / "fitted"
"""The data files of the fitted constants (shipped inside the package)."""


@functools.cache
def fitted_document(name: str) -> dict[str, Any]:
    """The data file fitted/`name`.json, read once: "what" it holds, the "machine" and
    "command" that measured it, the "method", the "date", the raw "results_file", its
    "values" and what each value means ("meaning")."""
    document: dict[str, Any] = json.loads((FITTED_DIR / f"{name}.json").read_text())
    return document


def fitted_values(name: str) -> dict[str, Any]:
    """The "values" of the data file fitted/`name`.json (read once; do not modify)."""
    values: dict[str, Any] = fitted_document(name)["values"]
    return values


def _fitted_source(name: str) -> str:
    """Where a data file's values come from, in one line, for a profile's `sources`."""
    document = fitted_document(name)
    return (
        f"fitted/{name}.json ({document['machine']}; `{document['command']}`, {document['date']})"
    )


# The flash kernel's rate on one H200 (FlashAttention-2 generation, exponentials exposed).
_FLASH_H200 = fitted_values("flash-attention-h200")
ATTENTION_MATMUL_FRACTION = float(_FLASH_H200["attention_matmul_fraction"])
"""R / the BF16 peak: the flash kernel's matmul rate on long calls (315 TFLOP/s on H200)."""
ATTENTION_RAMP_TOKENS = float(_FLASH_H200["attention_ramp_tokens"])
"""L0: a call over L tokens runs its matmuls at L / (L + L0) of R (short calls: fewer tiles
per SM to hide the prologue and epilogue)."""
EXP_PER_ENTRY = 2.0
"""Exponentials per score entry, forward + backward (FlashAttention-2 recomputes P in
backward; Dao 2023, Algorithm 2)."""

# Fitted on the published runs' fit subset.
_MEGATRON_FIT = fitted_values("megatron-published")
MEGATRON_ETA_MATMUL: dict[str, float] = {
    precision: float(eta) for precision, eta in _MEGATRON_FIT["eta_matmul"].items()
}

# GEMM tiles (output rows x columns a thread block computes): cuBLAS/CUTLASS's large BF16/FP8
# tile on Hopper and Blackwell, 256 x 128 (NVIDIA, "Matrix Multiplication Background User's
# Guide", section on tile and wave quantization, which uses the same tile on A100).
GEMM_TILE = (256, 128)


@dataclass(frozen=True)
class FrameworkProfile:
    """What one framework's kernels and overlap achieve, constant by constant (the docs' page on
    the step-time model explains each)."""

    name: FrameworkName
    eta_matmul: dict[str, float]
    """Fraction of the tensor-core peak a large GEMM reaches, by precision."""
    attention_fraction: float
    """The flash kernel's matmul rate on long calls / the BF16 peak."""
    attention_ramp_tokens: float
    """L0 of the length ramp (see ATTENTION_RAMP_TOKENS)."""
    exp_exposed: bool
    """Whether the softmax's exponentials add to the matmuls' time (FA2 generation) or hide
    behind them (FA3/cuDNN on Hopper: Shah et al. 2024, section 3.1)."""
    elementwise_fraction_of_hbm: float
    """Rate of the elementwise term per modelled byte / the HBM bandwidth (1: fused kernels at
    full bandwidth)."""
    loss_fraction_of_hbm: float
    """Rate of the loss's passes over its logits per modelled byte / the HBM bandwidth."""
    microbatch_overhead_seconds: float
    """Fixed cost per micro-batch outside the modelled work (launches, Python, data)."""
    overlap_dp: bool
    """Gradient/weight collectives overlap compute (Megatron's distributed optimizer); the
    bundled trainer all-reduces after the last backward."""
    expected_error: float
    """The model's typical relative error for this profile, from its own held-out check
    (ctxlaunch.perf.published.HELD_OUT_ROWS for megatron; the held-out 64K H200 step for the
    bundled trainer): what `plan` and `advise` state and rank ties within."""
    sources: str
    measured_on: str = ""
    """The GPU its constants and expected error were measured on ("" for the published runs'
    fit, measured on many)."""


def gemm_seconds(
    m: float,
    n: float,
    k: float,
    *,
    peak: float,
    eta: float,
    sm_count: int,
    hbm_bytes_per_second: float,
    element_bytes: float,
) -> float:
    """One GEMM C[m, n] = A[m, k] B[k, n]: the larger of its tensor-core time and its memory
    time. The tensor-core time is the FLOPs at `eta` x `peak`, divided by the last wave's
    occupancy (tiles of GEMM_TILE spread over `sm_count` SMs in whole waves: wave
    quantisation); the memory time reads A and B and writes C once at the HBM bandwidth (small
    or skinny GEMMs). `sm_count` 0 (the CPU): neither effect."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flop_time = 2.0 * m * n * k / (eta * peak)
    if sm_count <= 0 or hbm_bytes_per_second <= 0:
        return flop_time
    tm, tn = GEMM_TILE
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / sm_count)
    occupancy = tiles / (waves * sm_count)
    memory_time = element_bytes * (m * k + k * n + m * n) / hbm_bytes_per_second
    return max(flop_time / occupancy, memory_time)


def attention_seconds(
    entries: float,
    head_dim: int,
    call_tokens: float,
    *,
    peak: float,
    fraction: float,
    ramp_tokens: float,
    sfu_ops_per_second: float,
    exp_exposed: bool,
    matmul_flops_per_entry: float,
) -> float:
    """Flash attention over `entries` score entries (query x key pairs computed, all heads),
    each costing `matmul_flops_per_entry` x `head_dim` FLOPs (12 forward + backward, 16 with a
    recomputed forward), in calls of `call_tokens` tokens: the matmuls at `fraction` x `peak`
    x the length ramp, plus (FA2 generation) EXP_PER_ENTRY exponentials per entry at the SFU
    rate."""
    if entries <= 0:
        return 0.0
    ramp = call_tokens / (call_tokens + ramp_tokens) if ramp_tokens > 0 else 1.0
    seconds = entries * matmul_flops_per_entry * head_dim / (fraction * peak * ramp)
    if exp_exposed and sfu_ops_per_second > 0:
        seconds += entries * EXP_PER_ENTRY * matmul_flops_per_entry / 12.0 / sfu_ops_per_second
    return seconds


def solve_attention(
    calls: list[tuple[int, float, int, int]],
    *,
    peak: float,
    sfu_ops_per_second: float,
    exp_exposed: bool = True,
) -> tuple[float, float]:
    """(R / `peak`, L0) of the flash kernel from two timed causal calls, each (tokens, seconds
    of one forward + backward, heads, head_dim): the L0 at which both calls give the same
    matmul rate R once the exponentials are taken out as `attention_seconds` charges them
    (t = E x (12 d / (R x L / (L + L0)) + 2 / SFU), E = heads x L^2 / 2). Calls whose rate does
    not grow with length (noise, or a kernel with no ramp) give L0 = 0 and the longer call's
    rate."""

    def rates(ramp: float) -> list[float]:
        out = []
        for tokens, seconds, heads, head_dim in calls:
            entries = heads * tokens * tokens / 2
            exp = (
                entries * EXP_PER_ENTRY / sfu_ops_per_second
                if exp_exposed and sfu_ops_per_second > 0
                else 0.0
            )
            matmul_seconds = max(seconds - exp, seconds * 1e-3)
            out.append(12 * head_dim * entries / (matmul_seconds * tokens / (tokens + ramp)))
        return out

    ordered = sorted(calls)
    calls = [ordered[0], ordered[-1]]
    short_rate, long_rate = rates(0.0)
    if short_rate >= long_rate:
        return long_rate / peak, 0.0
    lo, hi = 0.0, 100.0 * calls[-1][0]
    for _ in range(100):  # rates(L0)[0] - rates(L0)[1] grows with L0: bisect for its zero
        mid = (lo + hi) / 2
        a, b = rates(mid)
        lo, hi = (mid, hi) if a < b else (lo, mid)
    return rates(lo)[1] / peak, lo


# The bundled trainer on one H200, calibrated by `calibration.gpu.measure_device`.
_BUNDLED_H200 = fitted_values("ctxlaunch-h200")

PROFILES: dict[str, FrameworkProfile] = {
    "ctxlaunch": FrameworkProfile(
        name="ctxlaunch",
        eta_matmul={
            **MEGATRON_ETA_MATMUL,
            "bf16": float(_BUNDLED_H200["eta_matmul_bf16"]),
        },
        attention_fraction=float(_BUNDLED_H200["attention_fraction"]),
        attention_ramp_tokens=float(_BUNDLED_H200["attention_ramp_tokens"]),
        exp_exposed=True,
        elementwise_fraction_of_hbm=float(_BUNDLED_H200["elementwise_fraction_of_hbm"]),
        loss_fraction_of_hbm=float(_BUNDLED_H200["loss_fraction_of_hbm"]),
        microbatch_overhead_seconds=float(_BUNDLED_H200["microbatch_overhead_seconds"]),
        overlap_dp=False,
        expected_error=float(_BUNDLED_H200["expected_error"]),
        sources="one H200 calibrated by the calibration job's code: BF16 GEMM efficiency of the "
        "model's projections, the attention kernel the trainer picks (cuDNN; exponentials "
        "charged), the blocks' elementwise rate, the loss's rate and the fixed cost per "
        "micro-batch from the trainer's own steps at two depths, "
        + _fitted_source("ctxlaunch-h200")
        + "; FP8 and FP32 GEMMs: the published runs' fit, "
        + _fitted_source("megatron-published")
        + "; expected error: the largest of seven trainer layouts on that H200 that the "
        "calibration never ran",
        measured_on="H200",
    ),
    "megatron": FrameworkProfile(
        name="megatron",
        eta_matmul=dict(MEGATRON_ETA_MATMUL),
        attention_fraction=ATTENTION_MATMUL_FRACTION,
        attention_ramp_tokens=ATTENTION_RAMP_TOKENS,
        exp_exposed=True,
        elementwise_fraction_of_hbm=1.0,
        loss_fraction_of_hbm=1.0,
        microbatch_overhead_seconds=0.0,
        overlap_dp=True,
        expected_error=float(_MEGATRON_FIT["expected_error"]),
        sources="GEMM efficiencies (BF16, FP8): fitted on the published runs' fit subset, "
        + _fitted_source("megatron-published")
        + "; attention: the flash kernel's rate measured on one H200 (FA2 generation, "
        "exponentials exposed where the GPU table has an SFU rate), "
        + _fitted_source("flash-attention-h200")
        + "; elementwise: fused at HBM bandwidth; expected error: what 6 of the 7 held-out "
        "published rows stay within (the seventh, Llama 3 at 131K, is 26 % slow)",
    ),
}


def profile(name: str) -> FrameworkProfile:
    """The profile called `name`; a clear error for any other."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"framework {name!r}: not a known profile (known: {', '.join(sorted(PROFILES))})"
        ) from None
