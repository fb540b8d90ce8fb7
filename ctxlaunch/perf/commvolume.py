"""Bytes each rank sends per optimizer step, per parallel dimension, for the trainer as built
(pure arithmetic, no torch; a step-time model divides these by link bandwidths).

Collectives are counted as ring algorithms send them (NCCL's and gloo's large-message
algorithms), per rank, for a group of g ranks and a tensor of N bytes:

    all-gather (N the gathered output)       (g - 1) / g * N
    reduce-scatter (N the unreduced input)   (g - 1) / g * N
    all-reduce                               2 * (g - 1) / g * N
    all-to-all (N the input)                 (g - 1) / g * N
    point-to-point send                      N

Per micro-batch, with n = micro_batch * seq_len / cp tokens on a CP rank, t = TP degree,
h = hidden, h_kv = K/V width, a = compute-dtype bytes (2 bf16, 4 fp32), r = 4 (the residual
stream: TP/PP engines keep fp32 weights, so it is fp32 under autocast too), per block:

- TP (sequence parallel): forward gathers the norm output twice (n*h*r each) and
  reduce-scatters the attention and feed-forward outputs (n*h*a each); backward runs the
  conjugates on the gradients (reduce-scatter n*h*r, all-gather n*h*a):
      4 * (t-1)/t * n*h*(r + a)
  plus, once per micro-batch, the embedding's reduce-scatter and its backward all-gather on
  the first stage, the loss input's all-gather and its backward reduce-scatter on the last
  (each (t-1)/t * n*h*4), and the vocabulary-parallel cross-entropy's all-reduces of 3 fp32
  per token, run again when the chunk is recomputed in backward:
      2 * 2 * (t-1)/t * n*3*4.
  Recomputation repeats the forward's share: full checkpointing 2 * (t-1)/t * n*h*(r + a)
  more per block, selective (the feed-forward half) half that.
- CP ring of N ranks: K and V of this TP rank's heads (n*h_kv/t*a each) travel N-1 hops in
  forward and again in backward, dK and dV (fp32) N-1 hops in backward:
      2 * (N-1) * n*h_kv/t * (2*a + 4);   full recomputation adds 2*(N-1)*n*h_kv/t*a.
- CP Ulysses of degree U: q, k, v to heads and the output back in forward, the same volume in
  backward: 2 * (U-1)/U * n*(2*h + 2*h_kv)/t * a. Hybrid: the Ulysses term with U plus the ring
  term with N = cp / U.
- PP: per micro-batch a stage sends its output activation (n/t*h*4) forward unless it is the
  last stage and the gradient of its input backward unless it is the first.
- DP x CP gradient reduction (ZeRO-0), g = dp * cp: an all-reduce of the rank's fp32 gradients
  once per step, 2*(g-1)/g * 4 * params; TP adds an all-reduce of the replicated RMSNorm gains'
  gradients, 2*(t-1)/t * 4 * norm params. (FSDP2, ZeRO >= 1: a reduce-scatter per micro-batch
  and parameter all-gathers instead; not modelled here.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec


@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends per optimizer step, by dimension."""

    tp: float
    cp: float
    pp: float
    dp: float

    @property
    def total(self) -> float:
        return self.tp + self.cp + self.pp + self.dp


def step_comm_bytes(model: ModelSpec, *, seq_len: int, micro_batch: int = 1,
                    grad_accum: int = 1, tp: int = 1, cp: int = 1, dp: int = 1,
                    cp_algorithm: str = "ring", ulysses: int = 1, dtype: str = "bf16",
                    activation_checkpointing: str = "none", stage_layers: int | None = None,
                    first_stage: bool = True, last_stage: bool = True,
                    stage_params: int = 0, norm_params: int = 0) -> CommVolume:
    """Bytes sent per optimizer step by one rank of a pipeline stage holding `stage_layers`
    blocks (default: all), per dimension; see the module docstring for each term.
    `stage_params`: parameters this rank holds (its TP slice of its stages) for the DP term;
    `norm_params`: the RMSNorm gains among them (replicated over TP)."""
    a = 2 if dtype == "bf16" else 4
    r = 4
    h, h_kv = model.hidden, model.kv_heads * (model.hidden // model.heads)
    layers = model.layers if stage_layers is None else stage_layers
    n = micro_batch * seq_len / cp
    frac_t = (tp - 1) / tp
    recompute = {"none": 0.0, "selective": 0.5, "full": 1.0}[activation_checkpointing]

    tp_block = (4 + 2 * recompute) * frac_t * n * h * (r + a)
    tp_edges = 0.0
    if tp > 1:
        tp_edges += 2 * frac_t * n * h * 4 * (first_stage + last_stage)
        tp_edges += 2 * 2 * frac_t * n * 3 * 4 * last_stage
    tp_bytes = grad_accum * (layers * tp_block + tp_edges)

    u = ulysses if cp_algorithm == "hybrid" else (cp if cp_algorithm == "ulysses" else 1)
    ring = cp // u
    kv_local = n * h_kv / tp
    ring_block = 2 * (ring - 1) * kv_local * (2 * a + 4) + recompute * 2 * (ring - 1) * kv_local * a
    ulysses_block = (2 + 2 * recompute / 2) * (u - 1) / u * n * (2 * h + 2 * h_kv) / tp * a \
        if u > 1 else 0.0
    cp_bytes = grad_accum * layers * (ring_block + ulysses_block) if cp > 1 else 0.0

    activation = n / tp * h * 4
    pp_bytes = grad_accum * activation * ((not last_stage) + (not first_stage))

    g = dp * cp
    dp_bytes = 2 * (g - 1) / g * 4 * stage_params + 2 * frac_t * 4 * norm_params
    return CommVolume(tp=tp_bytes, cp=cp_bytes, pp=pp_bytes, dp=dp_bytes)
