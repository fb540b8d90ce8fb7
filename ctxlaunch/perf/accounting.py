"""What a whole run costs before it starts: time to train, GPU-hours, energy and money, from the
step-time model's step and the job's steps (or its token budget), with the model's expected
error carried through as a range.

  time      steps x the predicted step (+/- the expected error; unknown where the step time is
            uncalibrated for the machine, and then said so).
  GPU-hours time x GPUs.
  energy    each GPU draws its board power (the GPU table's data-sheet TDP) while it computes
            and IDLE_POWER_FRACTION of it while it waits (exposed communication, the pipeline
            bubble, host copies, fixed overheads), so its mean power is
            idle + (board - idle) x busy, busy being the compute terms' share of the predicted
            step (the predicted utilisation); the rest of the node (CPUs, memory, NICs, switches,
            fans) draws its reference system's maximum less its GPUs' power for the whole run
            (contract.hardware.POWER_SOURCES), shared per GPU. IT power only: the data centre's
            cooling and conversion losses (its PUE) are not included.
  cost      GPU-hours x cluster.gpu_hour_price, where the spec gives a price.

Pure arithmetic on a StepTime and the spec's sections; `plan`, `advise`, `sweep` and the
Python API call `account`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ctxlaunch.contract.hardware import POWER_SOURCES, REFERENCE_NODE_GPUS

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.perf.machine import Machine
    from ctxlaunch.perf.steptime import StepTime

IDLE_POWER_FRACTION = 0.1
"""Assumed, not measured here: a data-centre GPU waiting on a collective draws about a tenth of
its board power (an idle H100 SXM board reads 60-80 W of its 700 W in nvidia-smi). It moves the
estimate only by the share of the step the GPUs wait."""

BUSY_TERMS = (
    "compute_matmul",
    "compute_attention",
    "compute_elementwise",
    "compute_loss",
    "optimizer",
)
"""The step-time terms during which a GPU computes; every other term it waits."""

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Estimate:
    """A figure and its range from the step time's expected error (low == high == value where
    the error is not known: `known` is then False)."""

    value: float
    low: float
    high: float
    known: bool

    @classmethod
    def of(cls, value: float, error: float) -> Estimate:
        """`value` +/- the relative `error` (0: no range known)."""
        return cls(value, value * (1 - error), value * (1 + error), error > 0)

    def scaled(self, factor: float) -> Estimate:
        return Estimate(self.value * factor, self.low * factor, self.high * factor, self.known)

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "low": self.low if self.known else None,
            "high": self.high if self.known else None,
        }


@dataclass(frozen=True)
class Accounting:
    """The whole run, before it starts."""

    steps: int
    tokens: int
    """Tokens the run trains (steps x tokens per step)."""
    gpus: int
    nodes: int
    step_seconds: float
    expected_error: float
    """The step time's expected relative error (0: not known for this machine)."""
    calibrated: bool
    """Whether the step time holds for the machine (perf.machine.Provenance)."""
    seconds: Estimate
    gpu_hours: Estimate
    busy_fraction: float
    """The share of the predicted step the GPUs compute (the rest they wait)."""
    gpu_watts: float
    """One GPU's mean power over a step (0: its power is not known)."""
    other_watts: float
    """The rest of the nodes' power, for the whole job."""
    energy_kwh: Estimate | None
    """The job's energy (GPUs and the rest of their nodes), None where the GPU's power is not
    known."""
    price_per_gpu_hour: float | None
    cost: Estimate | None
    power_source: str

    @property
    def mean_power_watts(self) -> float:
        """The job's mean power (its GPUs and the rest of their nodes)."""
        return self.gpus * self.gpu_watts + self.other_watts

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "step_seconds": self.step_seconds,
            "expected_error": self.expected_error,
            "calibrated": self.calibrated,
            "seconds": self.seconds.to_dict(),
            "gpu_hours": self.gpu_hours.to_dict(),
            "busy_fraction": self.busy_fraction,
            "gpu_watts": self.gpu_watts,
            "other_watts": self.other_watts,
            "mean_power_watts": self.mean_power_watts,
            "energy_kwh": self.energy_kwh.to_dict() if self.energy_kwh else None,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "cost": self.cost.to_dict() if self.cost else None,
            "power_source": self.power_source,
            "energy_model": "GPUs at board power while computing, "
            f"{IDLE_POWER_FRACTION:.0%} of it while waiting, plus the rest of the node; IT "
            "power, before the data centre's PUE",
        }

    def summary(self) -> str:
        """The run in one line: time, GPU-hours, energy, cost, each with its range."""
        parts = [
            f"{self.steps:,} steps ({self.tokens:,} tokens): {range_text(self.seconds, duration)}",
            f"{range_text(self.gpu_hours, amount)} GPU-hours",
        ]
        if self.energy_kwh is not None:
            parts.append(f"{range_text(self.energy_kwh, energy)}")
        if self.cost is not None:
            parts.append(
                f"cost {range_text(self.cost, amount)} "
                f"(at {self.price_per_gpu_hour:g} per GPU-hour)"
            )
        text = ", ".join(parts)
        if not self.calibrated:
            text += " (the step time is uncalibrated here: the range is unknown)"
        elif not self.expected_error:
            text += " (the step time's error is not measured: no range)"
        return text


def duration(seconds: float) -> str:
    """Seconds as the largest two units: 3 d 4 h, 5 h 12 min, 4 min 10 s, 12 s."""
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"
    minutes, sec = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {sec} s"


def amount(value: float) -> str:
    """A count of hours or money: whole above ten, two significant digits below."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def energy(kwh: float) -> str:
    """kWh, or MWh above a thousand."""
    return f"{kwh / 1000:,.1f} MWh" if kwh >= 1000 else f"{kwh:,.3g} kWh"


def range_text(figure: Estimate, show: Any) -> str:
    """`figure` as shown by `show`, with its range where it has one."""
    if not figure.known:
        return show(figure.value)
    return f"{show(figure.value)} ({show(figure.low)} to {show(figure.high)})"


def busy_fraction(step: StepTime) -> float:
    """The share of the predicted step the GPUs compute (BUSY_TERMS)."""
    if step.step_seconds <= 0:
        return 0.0
    busy = sum(step.terms.get(term, 0.0) for term in BUSY_TERMS)
    return min(1.0, busy / step.step_seconds)


def account(
    spec: JobSpec, step: StepTime, *, gpus_per_node: int | None = None, nodes: int | None = None
) -> Accounting:
    """The whole run of `spec` (its training.steps, which a token budget set) at the predicted
    `step`, on `nodes` x `gpus_per_node` GPUs (default: the spec's own)."""
    c = spec.cluster
    per_node = gpus_per_node or c.gpus_per_node
    node_count = nodes or c.nodes
    gpus = per_node * node_count
    steps = spec.training.steps
    error = step.expected_error if step.provenance.calibrated else 0.0
    seconds = Estimate.of(steps * step.step_seconds, error)
    gpu_hours = seconds.scaled(gpus / SECONDS_PER_HOUR)
    info = c.gpu_info
    busy = busy_fraction(step)
    gpu_watts = 0.0
    other_watts = 0.0
    energy_kwh = None
    if info.board_power_watts:
        idle = IDLE_POWER_FRACTION * info.board_power_watts
        gpu_watts = idle + (info.board_power_watts - idle) * busy
        other_watts = info.node_other_power_watts * gpus / REFERENCE_NODE_GPUS
        energy_kwh = seconds.scaled((gpus * gpu_watts + other_watts) / 1000 / SECONDS_PER_HOUR)
    price = c.price_per_gpu_hour
    return Accounting(
        steps=steps,
        tokens=steps * spec.tokens_per_step,
        gpus=gpus,
        nodes=node_count,
        step_seconds=step.step_seconds,
        expected_error=error,
        calibrated=step.provenance.calibrated,
        seconds=seconds,
        gpu_hours=gpu_hours,
        busy_fraction=busy,
        gpu_watts=gpu_watts,
        other_watts=other_watts,
        energy_kwh=energy_kwh,
        price_per_gpu_hour=price,
        cost=gpu_hours.scaled(price) if price is not None else None,
        power_source=POWER_SOURCES.get(c.gpu, ""),
    )


@dataclass(frozen=True)
class Prediction:
    """What the job is predicted to do, as the trainer reports it beside what it measures and
    `status` reads it back: the planner's peak memory and the step-time model's step, MFU and
    tokens/s, with the step's expected error (0: not known on this machine)."""

    step_seconds: float
    expected_error: float
    calibrated: bool
    peak_memory_bytes: int
    tokens_per_second_per_gpu: float
    mfu: dict[str, float]
    """By convention: full and causal (perf.flops)."""
    steps: int
    source: str
    """Where the step time's constants come from (perf.machine.Provenance's note)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_seconds": self.step_seconds,
            "expected_error": self.expected_error,
            "calibrated": self.calibrated,
            "peak_memory_bytes": self.peak_memory_bytes,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "mfu": dict(self.mfu),
            "steps": self.steps,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Prediction:
        """Read back what `to_dict` wrote (ValueError where it is not that)."""
        try:
            return cls(
                step_seconds=float(data["step_seconds"]),
                expected_error=float(data["expected_error"]),
                calibrated=bool(data["calibrated"]),
                peak_memory_bytes=int(data["peak_memory_bytes"]),
                tokens_per_second_per_gpu=float(data["tokens_per_second_per_gpu"]),
                mfu={str(k): float(v) for k, v in dict(data["mfu"]).items()},
                steps=int(data["steps"]),
                source=str(data.get("source", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a prediction ({exc})") from None


def job_prediction(spec: JobSpec, machine: Machine | None = None) -> Prediction:
    """The prediction of `spec` on `machine` (default: perf.machine.machine_for, the machine
    `plan` and the trainer both resolve for it)."""
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.memory import estimate
    from ctxlaunch.perf.steptime import predict

    layout = Layout.from_spec(spec)
    machine = machine or machine_for(spec)
    step = predict(spec.model, layout, machine)
    memory = estimate(spec.model, layout, spec.cluster.gpu_info)
    return Prediction(
        step_seconds=step.step_seconds,
        expected_error=step.expected_error if step.provenance.calibrated else 0.0,
        calibrated=step.provenance.calibrated,
        peak_memory_bytes=memory.total,
        tokens_per_second_per_gpu=step.tokens_per_second_per_gpu,
        mfu={str(convention): value for convention, value in step.mfu.items()},
        steps=spec.training.steps,
        source=step.provenance.note,
    )
