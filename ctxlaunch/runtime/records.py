"""What a training rank hands its observers: a step's metrics and an evaluation's result.

The trainer produces these records and telemetry exports them; both import this module, which
imports neither, so the two never import each other. torch loads only inside
`peak_memory_bytes`, so the CLI can read an evaluation's result back without it."""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StepMetrics:
    step: int
    """Steps completed (1-based)."""
    loss: float
    """Mean next-token loss over every predicted token of the global batch."""
    step_seconds: float
    tokens_per_second_per_gpu: float
    model_tflops_per_gpu_full: float
    model_tflops_per_gpu_causal: float
    peak_memory_bytes: int
    """This rank's peak: CUDA max allocated, or the process's peak RSS on the CPU."""
    lr: float
    grad_norm: float
    exposed_comm_seconds: float
    """Time this rank spent blocked on CP communication during the step (not hidden by
    compute)."""
    attention_balance: float = 1.0
    """The attention area the busiest rank of this rank's CP group computed in the step over
    the group's mean (1.0: every rank did the same; a ring waits for the busiest). Under a
    document mask it follows the sharding (`parallel.cp_sharding`)."""
    steps: int = 0
    """The optimizer steps the run is to complete (training.steps; 0: not said)."""
    progress: float = 0.0
    """The share of the run's steps done, 0 to 1."""
    remaining_seconds: float | None = None
    """Time left until the last step: the steps left at the run's mean measured step (the
    first, warm-up step left out), or at the predicted step before one is measured."""
    predicted_step_seconds: float | None = None
    """The step-time model's step for this job, to read the measured one against."""
    aux_loss: float = 0.0
    """A mixture-of-experts model's load-balancing loss of the step (before its coefficient,
    as transformers reports it; the mean over the micro-batches), apart from `loss`; 0 for a
    dense model."""
    expert_load: float = 1.0
    """The busiest expert's routings over the mean, in the layer where that is highest (1:
    every expert got the same; E / experts_per_token when every token goes to the same
    experts)."""
    expert_load_layers: tuple[float, ...] = ()
    """`expert_load` of each mixture-of-experts layer, in order."""
    expert_rank_load: float = 1.0
    """The routings the busiest rank of an EP group receives over the group's mean, in the
    layer where that is highest (what the all-to-all and the grouped GEMM wait for)."""
    tokens_dropped: int = 0
    """Routings dropped over capacity in the step, every rank and layer (0 unless
    model.moe.capacity_factor is set)."""


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory: CUDA max allocated, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass(frozen=True)
class Bucket:
    start: int
    stop: int
    """Context lengths [start, stop)."""
    tokens: int
    loss: float
    perplexity: float


@dataclass(frozen=True)
class PasskeyCell:
    length: int
    depth: float
    trials: int
    retrieved: int
    """Probes whose every answer token was the model's arg-max."""
    token_accuracy: float
    """Share of answer tokens that were the arg-max."""


@dataclass(frozen=True)
class EvalResult:
    step: int | None
    sequences: int
    tokens: int
    loss: float
    perplexity: float
    buckets: list[Bucket]
    passkey: list[PasskeyCell] = field(default_factory=list)
    passkey_note: str | None = None
    data: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        """Read back what `to_dict` wrote (keys it did not write are ignored)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["buckets"] = [Bucket(**b) for b in data["buckets"]]
        values["passkey"] = [PasskeyCell(**c) for c in data.get("passkey", [])]
        return cls(**values)

    def lines(self) -> list[str]:
        """The result as a table for the console."""
        out = [
            f"held-out loss {self.loss:.4f} (perplexity {self.perplexity:.2f}) over "
            f"{self.tokens:,} tokens in {self.sequences} sequences ({self.data})",
            "context length      tokens      loss   perplexity",
        ]
        for b in self.buckets:
            out.append(
                f"{b.start:>7,} - {b.stop:<8,} {b.tokens:>9,}  {b.loss:8.4f}  {b.perplexity:11.2f}"
            )
        if self.passkey:
            depths = sorted({c.depth for c in self.passkey})
            out.append("passkey retrieved (per depth)  " + "  ".join(f"{d:>5.2f}" for d in depths))
            for length in sorted({c.length for c in self.passkey}):
                row = {c.depth: c for c in self.passkey if c.length == length}
                out.append(
                    f"  length {length:>8,}             "
                    + "  ".join(f"{row[d].retrieved:>2}/{row[d].trials:<2}" for d in depths)
                )
        elif self.passkey_note:
            out.append(f"passkey: {self.passkey_note}")
        return out
