"""The machine a prediction runs on: its rates and links (`Machine`), the CPU calibration record
that `ctxlaunch calibrate` measures (ctxlaunch.runtime.calibration.cpu), and `machine_for`, the one
place that resolves a spec's machine for `plan`, `advise`, `submit`, `report` and telemetry."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxlaunch.contract.bounded import MAX_PROFILE_BYTES, BoundedReadError, read_bounded_object
from ctxlaunch.contract.fsutil import atomic_write_text
from ctxlaunch.contract.hardware import GPUS, LINKS, GpuInfo, LinkInfo
from ctxlaunch.contract.rundir import home
from ctxlaunch.perf.profiles import (
    ATTENTION_MATMUL_FRACTION,
    MEGATRON_ETA_MATMUL,
    FrameworkProfile,
    fitted_document,
    fitted_values,
    profile,
)

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec

# The Megatron profile's efficiencies (ctxlaunch.perf.profiles, where every constant is named
# with its source); kept here under their old names for what imports them.
ETA_MATMUL: dict[str, float] = dict(MEGATRON_ETA_MATMUL)
ETA_ATTENTION = ATTENTION_MATMUL_FRACTION
# Assumed, not fitted: NCCL bus bandwidth reaches ~80 % of the data-sheet link bandwidth for
# large messages (nccl-tests all-reduce / all-gather bus bandwidth on NVLink and NDR).
ETA_COMM = 0.8


@dataclass(frozen=True)
class Provenance:
    """Where a machine's step-time constants come from, and so how far to trust its figures."""

    state: str
    """measured-here: a CPU calibration taken on the machine asking; measured-elsewhere: a CPU
    calibration taken on another machine (its figures say nothing about this one);
    not-measured: the CPU table's placeholder rates; profile: a framework profile or a machine
    profile the spec names, measured where its note says."""
    note: str
    """The same in a sentence, for `plan` and `submit`."""
    calibrate: str = ""
    """How to calibrate where the figure is not calibrated for this machine ("" where it is)."""

    @property
    def calibrated(self) -> bool:
        """Whether the step-time figure holds for the machine it will run on."""
        return self.state in ("measured-here", "profile")


@dataclass(frozen=True)
class Machine:
    """What the model needs to know about the hardware: rates and links."""

    name: str
    peak_flops: dict[str, float]
    """Dense peak by precision (bf16, fp8, fp32), FLOP/s; on the CPU the measured rates."""
    memory_bytes_per_second: float
    gpus_per_node: int
    nvlink_domain: int
    intra_node: LinkInfo
    network: LinkInfo
    eta_matmul: dict[str, float] = field(default_factory=lambda: dict(ETA_MATMUL))
    eta_attention: float = ETA_ATTENTION
    """The flash kernel's matmul rate on long calls / the BF16 peak (profiles)."""
    eta_comm: float = ETA_COMM
    attention_flops_per_second: float | None = None
    """Measured attention rate (CPU calibration); None: eta_attention x the BF16 peak."""
    overlap_dp: bool = True
    """Whether gradient/weight collectives overlap compute (Megatron, DeepSpeed overlap_comm);
    the bundled trainer all-reduces after the last backward, so not on the CPU."""
    peak_reference_flops: float = 0.0
    """The peak MFU is stated against (BF16 on GPUs, as the published tables do)."""
    causal_tile_tokens: float = 0.0
    """A causal kernel computes its diagonal tiles whole: a causal call over S tokens costs
    S*(S + T)/2 score entries, not S*S/2. Measured on the CPU (T ~ 600 for torch's CPU flash
    kernel); 0 on GPUs, where T = 128 adds under 3 % at 4K and the fitted efficiency holds it.
    With zigzag sharding every algorithm has one diagonal per rank, so the excess is T/s."""
    sync_seconds: float = 0.0
    """Cost of every blocking synchronisation (ring hop, all-to-all, all-reduce) beyond the
    link's latency, never hidden by compute: on the CPU, where ranks can outnumber cores, the
    wait for a peer that is not scheduled (measured); 0 on GPUs."""
    sync_jitter: float = 0.0
    """How that wait grows with the compute between two synchronisations, in s / sqrt(s): a
    synchronisation after tau seconds of compute costs sync_seconds + sync_jitter x sqrt(tau).
    Each rank's compute is delayed by many small independent interruptions (other processes on
    its core), so the gap between the slowest rank and the others grows like the square root
    of the compute, the spread of a sum of independent delays (measured on the CPU; 0 on
    GPUs)."""
    microbatch_overhead_seconds: float = 0.0
    """Fixed cost per micro-batch outside the modelled work (Python dispatch, data, loss and
    optimizer bookkeeping): measured on the CPU, and on a GPU by its calibration (the bundled
    profile's from its H200 one); 0 under the Megatron profile, whose fitted efficiencies
    absorb it."""
    elementwise_bytes_per_second: float | None = None
    """Rate of the elementwise term (norms, RoPE, SwiGLU, residual adds) per modelled byte;
    None: the memory bandwidth. On the CPU it is measured on the model itself: eager torch
    runs those small kernels far below a large copy's bandwidth; on GPUs the profile's
    fraction of the HBM bandwidth."""
    loss_bytes_per_second: float | None = None
    """Rate of the loss's passes over its logits per modelled byte (steptime.LOSS_BYTES_PER_
    LOGIT); None: the elementwise rate. Long rows of one large tensor, so on a GPU it runs much
    nearer the bandwidth than the blocks' small kernels do (measured apart by the GPU
    calibration)."""
    framework: str = "ctxlaunch"
    """Whose kernels and overlap the rates describe (ctxlaunch.perf.profiles)."""
    sm_count: int = 0
    """SMs the GEMM tiles fill in waves; 0 (the CPU): no wave quantisation, no memory bound."""
    sfu_ops_per_second: float = 0.0
    """Exponential rate; with `exp_exposed` the softmax adds to the attention time."""
    exp_exposed: bool = False
    attention_ramp_tokens: float = 0.0
    """L0 of the attention length ramp (profiles.ATTENTION_RAMP_TOKENS); 0: none."""
    expected_error: float = 0.0
    """The relative error measured for these constants on the machine they were measured on
    (0: not known, e.g. placeholders or another machine's calibration)."""
    provenance: Provenance = field(
        default_factory=lambda: Provenance("profile", "the GPU table and a framework profile")
    )
    """Where the constants come from (machine_for sets it)."""
    host_link: LinkInfo | None = None
    """The GPU's link to its host's memory (PCIe), what offloading copies over; None (the
    CPU): a copy within the same memory, at `memory_bytes_per_second`."""
    host_memory_bytes_per_second: float = 0.0
    """The node's host memory bandwidth, shared by its ranks: an offloaded optimizer steps
    there; 0 (the CPU): `memory_bytes_per_second`, already the rank's share."""

    @classmethod
    def from_gpu(
        cls,
        gpu: GpuInfo,
        *,
        network: str,
        gpus_per_node: int,
        nvlink_domain: int | None = None,
        framework: str = "ctxlaunch",
        **changes: Any,
    ) -> Machine:
        """The data-sheet machine of `gpu` over the `network` fabric, timed with the kernels
        and overlap of `framework` (a profile of ctxlaunch.perf.profiles)."""
        prof: FrameworkProfile = profile(framework)
        peaks = {"bf16": gpu.peak_bf16_flops, "fp32": gpu.peak_fp32_flops}
        if gpu.fp8:
            peaks["fp8"] = 2 * gpu.peak_bf16_flops
        domain = nvlink_domain or gpu.nvlink_domain
        machine = cls(
            name=gpu.name,
            peak_flops=peaks,
            memory_bytes_per_second=gpu.hbm_bytes_per_second,
            gpus_per_node=gpus_per_node,
            nvlink_domain=domain,
            intra_node=LINKS[gpu.intra_node_link],
            network=LINKS[network],
            peak_reference_flops=gpu.peak_bf16_flops,
            eta_matmul=dict(prof.eta_matmul),
            eta_attention=prof.attention_fraction,
            overlap_dp=prof.overlap_dp,
            elementwise_bytes_per_second=(
                prof.elementwise_fraction_of_hbm * gpu.hbm_bytes_per_second
                if prof.elementwise_fraction_of_hbm < 1
                else None
            ),
            loss_bytes_per_second=(
                prof.loss_fraction_of_hbm * gpu.hbm_bytes_per_second
                if prof.loss_fraction_of_hbm < 1
                else None
            ),
            microbatch_overhead_seconds=prof.microbatch_overhead_seconds,
            framework=prof.name,
            sm_count=gpu.sm_count,
            sfu_ops_per_second=gpu.sfu_ops_per_second,
            exp_exposed=prof.exp_exposed,
            attention_ramp_tokens=prof.attention_ramp_tokens,
            expected_error=prof.expected_error,
            host_link=LINKS[gpu.host_link] if gpu.name != "cpu" else None,
            host_memory_bytes_per_second=gpu.node_host_bytes_per_second,
        )
        return dataclasses.replace(machine, **changes) if changes else machine

    def link_for_span(self, span: int) -> LinkInfo:
        """The slowest link a group of `span` consecutive ranks crosses."""
        if span <= min(self.gpus_per_node, max(self.nvlink_domain, 1)):
            return self.intra_node
        return self.network

    def bandwidth(self, link: LinkInfo) -> float:
        """Bytes per second a collective achieves over `link`."""
        return self.eta_comm * link.bytes_per_second

    def host_copy_bytes_per_second(self) -> float:
        """What a copy between a rank's device and host memory achieves, each direction."""
        if self.host_link is None:
            return self.memory_bytes_per_second
        return self.bandwidth(self.host_link)

    def host_step_bytes_per_second(self, ranks_per_node: int) -> float:
        """One rank's share of the host memory bandwidth, for an optimizer step there."""
        if not self.host_memory_bytes_per_second:
            return self.memory_bytes_per_second
        return self.host_memory_bytes_per_second / max(ranks_per_node, 1)


@dataclass(frozen=True)
class Calibration:
    """What a CPU rank achieves here: rates measured with all cores in one process."""

    matmul_flops_per_second: float
    attention_flops_per_second: float
    """Attention through the trainer's kernels, forward + backward, on a full (non-causal)
    block: FLOPs per second."""
    memory_bytes_per_second: float
    link_bytes_per_second: float
    """gloo over loopback between two processes, one direction."""
    link_latency_seconds: float
    cores: int
    measured_at: str = ""
    host: dict[str, Any] | None = None
    """The machine it was measured on (`host_signature()`): the rates hold there only. None:
    saved before the host was recorded (treated as another machine)."""
    microbatch_overhead_seconds: float = 0.0
    """One rank's fixed cost per micro-batch: the intercept of the real model's step (forward,
    backward, AdamW) at two short lengths, less what the model predicts for that work."""
    causal_tile_tokens: float = 0.0
    """What a causal call wastes on its diagonal, in tokens (see steptime.Machine)."""
    sync_seconds: dict[str, float] | None = None
    """Ranks -> the cost of one ring exchange between compute steps, beyond the compute, with
    that many processes sharing the cores, stated at no compute between them (s0 of
    `calibration.fitting.fit_sync_jitter`; without a growth, the reading between 0.1 ms
    compute steps)."""
    sync_jitter: dict[str, float] | None = None
    """Ranks -> how that cost grows with the compute between exchanges (Machine.sync_jitter),
    from a second measurement between longer compute steps
    (`calibration.fitting.fit_sync_jitter`)."""
    elementwise_bytes_per_second: float = 0.0
    """What the model's elementwise work (norms, RoPE, SwiGLU, adds) achieves per modelled byte,
    with all cores: fitted on the real model's step at two short lengths (0: not measured, the
    copy bandwidth stands in)."""
    attention_ramp_tokens: float = 0.0
    """L0 of attention's length ramp on the calibrated CPU: a call over L tokens runs at
    attention_flops_per_second x L / (L + L0) (fitted on two block lengths none of the
    benchmark's calls use; 0: one rate for every length)."""
    trust: dict[str, Any] | None = None
    """What the machine did while it was measured, and how far the readings agreed:
    `others_cores` (other processes' busy cores on average), `readings` (each rate's readings)
    and `spread` ((max - min) / median of each), as runtime.calibration.trust reads them."""
    one_thread: dict[str, float] | None = None
    """The same rates with one thread ("matmul", "attention", "elementwise", and the attention
    ramp's "attention_ramp_tokens"): what a rank
    achieves when ranks outnumber or match the cores and each runs one thread. Threads in one
    process do not scale linearly, so N such ranks together outrun one process with N
    threads."""

    def _per_rank(self, all_cores: float, kind: str, share: int) -> float:
        """A rate per rank when `share` ranks divide the cores: with at least as many ranks as
        cores each runs one thread, time-sliced (the one-thread rate x cores / ranks);
        otherwise each gets 1/share of the all-core process's rate."""
        one = (self.one_thread or {}).get(kind, 0.0)
        if one > 0 and share >= self.cores:
            return one * self.cores / share
        return all_cores / share

    def _attention_ramp(self, share: int) -> float:
        """The ramp of the rate `_per_rank` picks: one thread's when ranks fill the cores."""
        one = self.one_thread or {}
        if one.get("attention", 0.0) > 0 and share >= self.cores:
            return one.get("attention_ramp_tokens", 0.0)
        return self.attention_ramp_tokens

    def machine(self, gpus_per_node: int) -> Machine:
        """N ranks share the cores (see `_per_rank`)."""
        share = max(gpus_per_node, 1)
        rate = self._per_rank(self.matmul_flops_per_second, "matmul", share)
        # Ranks filling the cores run one thread each; more ranks than cores time-slice it.
        overhead = self.microbatch_overhead_seconds
        one_thread_overhead = (self.one_thread or {}).get("microbatch_overhead")
        if share >= self.cores and one_thread_overhead:
            overhead = one_thread_overhead
        overhead *= max(1.0, share / max(self.cores, 1))
        link = LinkInfo(
            "gloo loopback (measured)",
            self.link_bytes_per_second,
            self.link_latency_seconds,
            f"measured {self.measured_at}",
        )
        syncs = {int(k): v for k, v in (self.sync_seconds or {}).items()}
        nearest = min(syncs, key=lambda k: (abs(k - share), k)) if syncs else None
        sync = jitter = 0.0
        if nearest is not None and share > 1:
            sync = syncs[nearest]
            jitter = (self.sync_jitter or {}).get(str(nearest), 0.0)
        return Machine(
            name="cpu",
            peak_flops={"bf16": rate, "fp32": rate},
            memory_bytes_per_second=self.memory_bytes_per_second / share,
            gpus_per_node=gpus_per_node,
            nvlink_domain=gpus_per_node,
            intra_node=link,
            network=link,
            eta_matmul={"bf16": 1.0, "fp32": 1.0},
            eta_comm=1.0,
            attention_flops_per_second=self._per_rank(
                self.attention_flops_per_second, "attention", share
            ),
            attention_ramp_tokens=self._attention_ramp(share),
            overlap_dp=False,
            peak_reference_flops=rate,
            microbatch_overhead_seconds=overhead,
            sync_seconds=sync,
            sync_jitter=jitter,
            causal_tile_tokens=self.causal_tile_tokens,
            elementwise_bytes_per_second=(
                self._per_rank(self.elementwise_bytes_per_second, "elementwise", share) or None
            ),
        )


@dataclass(frozen=True)
class GpuCalibration:
    """What the bundled trainer achieves on one GPU type and fabric, measured there by the
    calibration job (ctxlaunch.runtime.calibration.gpu): the `ctxlaunch` profile's fitted and
    table constants replaced by the measured ones. Rates are fractions of the GPU table's
    peaks and bandwidth, so the profile's shape-level physics (wave quantisation, the length
    ramp) still applies to every layout."""

    gpu: str
    """The GPU table's key (cluster.gpu) the profile was measured for."""
    device_name: str
    """What the device called itself (torch.cuda.get_device_name), or "cpu (dry run)"."""
    network: str
    gpus_per_node: int
    precision: str
    """The compute precision the matmul efficiency was measured in (the model's dtype)."""
    eta_matmul: float
    """Large-GEMM efficiency at which the model's GEMM times sum to the measured projections."""
    attention_fraction: float
    """The trainer's attention kernel's matmul rate on long calls / the peak."""
    attention_ramp_tokens: float
    attention_kernel: str
    """The kernel the trainer picked (cp.kernel_choice), whose rate this is."""
    collectives: dict[str, dict[str, float]]
    """op -> {"bus_bytes_per_second", "latency_seconds"} among the node's GPUs (empty: one GPU
    per node, the link tables stand)."""
    dry_run: bool = False
    """Measured by the GPU code path on a CPU (checks the job; not a GPU's figures)."""
    measured_at: str = ""
    elementwise_fraction_of_hbm: float = 1.0
    loss_fraction_of_hbm: float | None = None
    """The loss's rate (steptime.LOSS_BYTES_PER_LOGIT) / the HBM bandwidth, measured apart from
    the blocks' elementwise rate by running the trainer at two depths; None (a profile saved
    before it was measured): the elementwise rate."""
    microbatch_overhead_seconds: float = 0.0
    expected_error: float = 0.0
    """|error| of the trainer step the calibration held out, predicted with every constant
    above (0: not measured)."""
    lengths: dict[str, Any] = field(default_factory=dict)
    """The lengths each part was measured at."""
    trainer_step_seconds: dict[str, float] = field(default_factory=dict)
    """The trainer's measured step at each calibration length."""

    def machine(self, gpus_per_node: int) -> Machine:
        """The `ctxlaunch` profile's machine for this GPU and fabric with the measured
        constants; the intra-node link is the collectives' median bus bandwidth and latency
        (the model's `eta_comm` is taken back out, since the measurement already holds it)."""
        base = Machine.from_gpu(
            GPUS[self.gpu], network=self.network, gpus_per_node=gpus_per_node, framework="ctxlaunch"
        )
        eta = dict(base.eta_matmul)
        eta[self.precision] = self.eta_matmul
        intra = base.intra_node
        if self.collectives:
            bus = sorted(c["bus_bytes_per_second"] for c in self.collectives.values())
            latency = sorted(c["latency_seconds"] for c in self.collectives.values())
            intra = LinkInfo(
                f"{intra.name} (measured)",
                bus[len(bus) // 2] / base.eta_comm,
                latency[len(latency) // 2],
                f"{self.device_name}, measured {self.measured_at}",
            )
        return dataclasses.replace(
            base,
            name=f"{self.gpu} (measured)",
            eta_matmul=eta,
            eta_attention=self.attention_fraction,
            attention_ramp_tokens=self.attention_ramp_tokens,
            elementwise_bytes_per_second=(
                self.elementwise_fraction_of_hbm * base.memory_bytes_per_second
            ),
            loss_bytes_per_second=(
                self.elementwise_fraction_of_hbm
                if self.loss_fraction_of_hbm is None
                else self.loss_fraction_of_hbm
            )
            * base.memory_bytes_per_second,
            microbatch_overhead_seconds=self.microbatch_overhead_seconds,
            intra_node=intra,
            expected_error=self.expected_error,
        )


def calibration_path() -> Path:
    """Where `ctxlaunch calibrate` saves the CPU constants."""
    return home() / "cpu_calibration.json"


def load_calibration(path: Path | None = None) -> Calibration | None:
    """The saved CPU constants; None where none are saved (or the file is not a calibration:
    read with bounds, each constant of its type)."""
    path = path or calibration_path()
    try:
        data = read_bounded_object(path, MAX_PROFILE_BYTES, "the CPU calibration")
        return typed_record(Calibration, data)
    except ValueError:
        return None


def typed_record(cls: Any, data: Any) -> Any:
    """`cls` (a dataclass) from `data`, each field of its annotated type (a float finite; a
    dict a JSON object): ValueError naming the field that is not, or one `cls` lacks."""
    import math
    import types
    import typing

    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ValueError(f"unknown field {unknown[0][:60]!r}")
    for name, value in data.items():
        hint = hints[name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = typing.get_args(hint) if union else (hint,)
        origins = {typing.get_origin(k) or k for k in kinds}
        if value is None and type(None) in origins:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} is {value}, not a finite number")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        fits = (
            (float in origins and number)
            or (int in origins and isinstance(value, int) and not isinstance(value, bool))
            or any(k in origins and isinstance(value, k) for k in (str, bool, dict, list))
            or Any in origins
        )
        if not fits:
            raise ValueError(f"{name} is a {type(value).__name__}")
    try:
        return cls(**data)
    except TypeError as exc:  # a field it needs is missing
        raise ValueError(str(exc).split(") ", 1)[-1]) from None


def save_calibration(calibration: Calibration, path: Path | None = None) -> Path:
    """Save the CPU constants atomically; returns the path written."""
    return atomic_write_text(
        path or calibration_path(), json.dumps(asdict(calibration), indent=2) + "\n"
    )


def profile_path_for(spec: JobSpec, spec_path: Path | None = None) -> Path:
    """Where `calibrate --submit` saves `spec`'s machine profile by default:
    profiles/<gpu>-<fabric>.json beside the spec file (the working directory without one), a
    file a team can commit and name in cluster.profile."""
    base = spec_path.parent if spec_path is not None else Path.cwd()
    return base / "profiles" / f"{spec.cluster.gpu}-{spec.fabric.network}.json"


def save_profile(calibration: Calibration | GpuCalibration, spec: JobSpec, path: Path) -> Path:
    """Write a machine profile atomically: the measured constants keyed by the GPU type and
    fabric of `spec` (what cluster.profile checks), with the node shape they were taken on."""
    from ctxlaunch.contract.spec import PROFILE_FORMAT

    data = {
        "format": PROFILE_FORMAT,
        "gpu": spec.cluster.gpu,
        "fabric": spec.fabric.network,
        "framework": "ctxlaunch",
        "kind": "gpu" if isinstance(calibration, GpuCalibration) else "cpu",
        "nodes": spec.cluster.nodes,
        "gpus_per_node": spec.cluster.gpus_per_node,
        "model": spec.model.preset or "custom",
        "measured_at": calibration.measured_at,
        "calibration": asdict(calibration),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def load_profile(path: Path) -> Calibration | GpuCalibration:
    """The constants of a machine profile (a GPU node's, or a CPU's); ValueError naming the
    file when it is not one."""
    try:
        data = read_bounded_object(path, MAX_PROFILE_BYTES, "the machine profile")
        kind = GpuCalibration if data.get("kind") == "gpu" else Calibration
        return typed_record(kind, data.get("calibration"))
    except BoundedReadError as exc:
        raise ValueError(f"cluster.profile: {exc}") from None
    except ValueError as exc:
        raise ValueError(
            f"cluster.profile: {path} is not a machine profile (its calibration: {exc})"
        ) from None


CPU_MODEL = "ctxlaunch-cpu"
"""The data file with the CPU calibration's own expected error and cost (perf/fitted/)."""


def host_signature() -> dict[str, Any]:
    """What a CPU calibration's rates depend on: the processor model and the core count (the
    host name is left out: identical machines calibrate alike)."""
    import os
    import platform

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cores": os.cpu_count() or 1,
    }


def _describe_host(host: dict[str, Any] | None) -> str:
    if not host:
        return "an unrecorded machine"
    return f"{host.get('cpu') or 'an unknown CPU'} x {host.get('cores', '?')} cores"


def calibrate_hint() -> str:
    """How to calibrate this machine, and about how long it took on the machine the CPU model's
    data file names (its `machine`)."""
    document = fitted_document(CPU_MODEL)
    seconds = document["values"]["calibration_seconds"]
    return (
        f"run `ctxlaunch calibrate` (about {seconds / 60:.0f} min on the machine it was timed "
        f"on: {document['machine']})"
    )


def _cpu_machine(measured: Calibration, per_node: int, source: str) -> Machine:
    """A CPU calibration's machine, trusted (with its measured error) only on its own host."""
    machine = measured.machine(gpus_per_node=per_node)
    here = host_signature()
    if measured.host == here:
        return dataclasses.replace(
            machine,
            expected_error=float(fitted_values(CPU_MODEL)["expected_error"]),
            provenance=Provenance(
                "measured-here", f"calibrated on this machine ({source}, {measured.measured_at})"
            ),
        )
    return dataclasses.replace(
        machine,
        expected_error=0.0,
        provenance=Provenance(
            "measured-elsewhere",
            f"the CPU constants ({source}) were measured on {_describe_host(measured.host)}, "
            f"not on this machine ({_describe_host(here)}): the step time is uncalibrated here",
            calibrate_hint(),
        ),
    )


def machine_for(
    spec: JobSpec,
    *,
    gpus_per_node: int | None = None,
    calibration: Calibration | None = None,
    saved: bool = True,
    framework: str = "ctxlaunch",
) -> Machine:
    """The machine `spec` runs on, with `gpus_per_node` (default: the spec's own; how many
    nodes does not change a node's rates): the GPU and fabric tables timed with `framework`'s
    profile (default the bundled trainer's); the constants of the machine profile the spec
    names (cluster.profile) when it names one, ahead of `calibration`; or on `gpu: cpu` the
    constants `ctxlaunch calibrate` measured on the machine running the command
    (`calibration`, else the saved ones unless `saved` is False; the tables' placeholders
    where none were measured)."""
    c = spec.cluster
    per_node = gpus_per_node or c.gpus_per_node
    if c.profile is not None:  # the spec's own machine, ahead of any local calibration
        named = load_profile(Path(c.profile)).machine(gpus_per_node=per_node)
        return dataclasses.replace(
            named,
            provenance=Provenance(
                "profile", f"the machine profile {c.profile} (cluster.profile), measured there"
            ),
        )
    if c.gpu == "cpu":
        if calibration is not None:
            return _cpu_machine(calibration, per_node, "the calibration given")
        measured = load_calibration() if saved else None
        if measured is not None:
            return _cpu_machine(measured, per_node, str(calibration_path()))
        placeholders = Machine.from_gpu(
            c.gpu_info, network=spec.fabric.network, gpus_per_node=per_node, framework=framework
        )
        return dataclasses.replace(
            placeholders,
            expected_error=0.0,
            provenance=Provenance(
                "not-measured",
                "no CPU calibration: the step time uses the CPU table's placeholder rates",
                calibrate_hint(),
            ),
        )
    machine = Machine.from_gpu(
        c.gpu_info,
        network=spec.fabric.network,
        gpus_per_node=per_node,
        nvlink_domain=spec.nvlink_domain,
        framework=framework,
    )
    return dataclasses.replace(machine, provenance=profile_provenance(framework, c.gpu))


def profile_provenance(framework: str, gpu: str) -> Provenance:
    """Where a framework profile's constants come from, for a job on `gpu`: its fitted data's
    machine; on another GPU type, scaled from it through the GPU tables."""
    prof = profile(framework)
    measured_on = prof.measured_on
    if not measured_on or gpu in measured_on:
        where = f"an {measured_on}" if measured_on else "the published runs"
        return Provenance("profile", f"the {framework} profile, measured on {where}")
    return Provenance(
        "profile",
        f"the {framework} profile, measured on an {measured_on} and scaled to {gpu} through the "
        f"GPU tables; the error was measured on the {measured_on}",
        f"`ctxlaunch calibrate SPEC --submit` measures your {gpu} nodes",
    )
