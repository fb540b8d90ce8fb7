"""The step-time model: how long one optimizer step takes for a layout, term by term.

Pure arithmetic over the layout (`StepLayout`) and the machine (`Machine`: GPU and fabric
tables, or the constants measured on this CPU); no I/O, no torch. `plan`, `advise`, `report`
and the CPU self-check all call `predict`.

One rank of the busiest pipeline stage, one micro-batch of b sequences of s tokens; n = b*s/cp
tokens held by the rank (CP splits the sequence), TP shards heads and weights:

  compute      matmul FLOPs executed (6 per weight per token, +2 for every recomputed
               forward) at eta_matmul x the peak of the matmul precision (FP8 peak = 2 x BF16
               on Hopper/Blackwell); causal attention FLOPs executed (half the score matrix:
               6*h*s per layer per token, +2*h*s when recomputed) at eta_attention x the BF16
               peak (flash attention runs in BF16 under FP8 recipes); elementwise work (norms,
               RoPE, SwiGLU, residuals, casts) as HBM traffic: 3 passes (forward write,
               backward read and gradient write) over the bytes a block saves per token, at the
               data-sheet HBM bandwidth.
  TP           Megatron sequence parallelism: per layer 2 all-gathers + 2 reduce-scatters in
               forward, as many in backward (and again in a recomputed forward), each moving
               (t-1)/t x n*h*2 bytes; not overlapped.
  CP ring      r-1 hops per layer; per hop a rank sends its K/V block (2 x n_ring x h_kv/t
               x 2 bytes) in forward, K/V and dK/dV (fp32) in backward, while it computes the
               attention of the block in hand (its attention work / r). Only the part of each
               transfer longer than that compute is exposed.
  Ulysses      two all-to-alls per layer in forward (q, k, v in; out back), two in backward:
               (u-1)/u x n x (2h + 2h_kv)/t x 2 bytes each way; not overlapped. Hybrid:
               Ulysses over u ranks inside, a ring over cp/u outside.
  PP           the schedule's bubble: (p-1)/v micro-batch times on top of the m micro-batches
               (1F1B: v = 1; interleaved: v virtual stages per rank) [Narayanan et al. 2021];
               activations sent between stages during fill and drain.
  DP / ZeRO    over the DP x CP ranks holding replicas: all-reduce of the gradients (ZeRO-0),
               reduce-scatter of the gradients + all-gather of the weights (ZeRO-1/2), and under
               ZeRO-3 the weights gathered for every micro-batch's forward and backward. Where
               the framework overlaps them (`Machine.overlap_dp`) they hide behind one
               micro-batch of compute; only the rest is exposed.
  optimizer    Adam reads and writes ~32 bytes per parameter the rank updates, at HBM speed.
  overhead     a fixed cost per micro-batch (Python dispatch, data, bookkeeping), and a cost per
               blocking synchronisation (ring hop, all-to-all, all-reduce) that compute cannot
               hide: both measured on the CPU (where ranks can outnumber cores, a peer may not
               be scheduled); 0 on GPUs.

Collectives move bytes at eta_comm x the data-sheet bandwidth of the slowest link their group
spans (NVLink inside the NVLink domain; the network beyond it, one NIC per GPU) plus one
latency per ring step. Every constant is a data-sheet value (ctxlaunch.contract.hardware), measured on
this machine (ctxlaunch.runtime.calibrate), or one of the fitted efficiencies below; the README lists
which.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ctxlaunch.contract.hardware import LINKS, GpuInfo, LinkInfo
from ctxlaunch.perf.flops import CONVENTIONS, count_params, flops_per_token
from ctxlaunch.perf.memory import MemoryLayout, block_activation_bytes_per_token, params_per_rank

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec, ModelSpec

MatmulPrecision = Literal["bf16", "fp8", "fp32"]

# Fitted on the published runs (tests/test_published_runs.py; benchmarks/fit_steptime.py
# prints the fit): the achievable fraction of the tensor-core peak for the weight matmuls, BF16
# and FP8 (FP8 GEMMs reach a smaller share of their doubled peak, and FP8 recipes add scaling
# and casts), and for causal flash attention. Three numbers for every row of every table, not
# one per row.
ETA_MATMUL: dict[str, float] = {"bf16": 0.86, "fp8": 0.50, "fp32": 0.86}
ETA_ATTENTION = 0.31
# Assumed, not fitted: NCCL bus bandwidth reaches ~80 % of the data-sheet link bandwidth for
# large messages (nccl-tests all-reduce / all-gather bus bandwidth on NVLink and NDR).
ETA_COMM = 0.8
ELEMENTWISE_HBM_PASSES = 3.0
OPTIMIZER_BYTES_PER_PARAM = 32.0


@dataclass(frozen=True)
class StepLayout:
    """The slice of a job the step-time model reads: the memory layout plus the knobs that
    change time but not memory."""

    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    cp_algorithm: str = "ring"
    ulysses_degree: int = 1
    """Ulysses (inner) degree: cp for ulysses, 1 for ring, the spec's for hybrid."""
    virtual_stages: int = 1
    """Interleaved pipeline: model chunks per rank (1 = plain 1F1B)."""
    zero_stage: int = 0
    activation_checkpointing: str = "none"
    dtype: str = "bf16"
    matmul_precision: MatmulPrecision = "bf16"
    """Precision of the weight matmuls; fp8 runs them at twice the BF16 peak."""

    @classmethod
    def from_spec(cls, spec: JobSpec, **changes: object) -> StepLayout:
        t, p = spec.training, spec.parallel
        layout = cls(
            seq_len=t.seq_len, micro_batch=t.micro_batch, grad_accum=spec.grad_accum,
            tp=p.tp, pp=p.pp, cp=p.cp, dp=spec.dp, cp_algorithm=p.cp_algorithm,
            ulysses_degree=spec.ulysses_degree, virtual_stages=p.virtual_stages,
            zero_stage=t.zero_stage, activation_checkpointing=t.activation_checkpointing,
            dtype=spec.model.dtype, matmul_precision="bf16" if spec.model.dtype == "bf16"
            else "fp32")
        return dataclasses.replace(layout, **changes) if changes else layout

    def replace(self, **changes: object) -> StepLayout:
        return dataclasses.replace(self, **changes)

    def memory(self) -> MemoryLayout:
        return MemoryLayout(
            seq_len=self.seq_len, micro_batch=self.micro_batch, grad_accum=self.grad_accum,
            tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, cp_algorithm=self.cp_algorithm,
            zero_stage=self.zero_stage,
            activation_checkpointing=self.activation_checkpointing,  # type: ignore[arg-type]
            dtype=self.dtype)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def ring_degree(self) -> int:
        return self.cp // self.ulysses_degree

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum * self.dp


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
    microbatch_overhead_seconds: float = 0.0
    """Fixed cost per micro-batch outside the modelled work (Python dispatch, data, loss and
    optimizer bookkeeping): measured on the CPU; 0 on GPUs, where the fitted efficiencies
    absorb it."""
    elementwise_bytes_per_second: float | None = None
    """Rate of the elementwise term (norms, RoPE, SwiGLU, residual adds) per modelled byte;
    None: the memory bandwidth. On the CPU it is measured on the model itself: eager torch
    runs those small kernels far below a large copy's bandwidth."""

    @classmethod
    def from_gpu(cls, gpu: GpuInfo, *, network: str, gpus_per_node: int,
                 nvlink_domain: int | None = None, **changes: object) -> Machine:
        peaks = {"bf16": gpu.peak_bf16_flops, "fp32": gpu.peak_fp32_flops}
        if gpu.fp8:
            peaks["fp8"] = 2 * gpu.peak_bf16_flops
        domain = nvlink_domain or gpu.nvlink_domain
        machine = cls(name=gpu.name, peak_flops=peaks,
                      memory_bytes_per_second=gpu.hbm_bytes_per_second,
                      gpus_per_node=gpus_per_node, nvlink_domain=domain,
                      intra_node=LINKS[gpu.intra_node_link], network=LINKS[network],
                      peak_reference_flops=gpu.peak_bf16_flops)
        return dataclasses.replace(machine, **changes) if changes else machine

    def link_for_span(self, span: int) -> LinkInfo:
        """The slowest link a group of `span` consecutive ranks crosses."""
        if span <= min(self.gpus_per_node, max(self.nvlink_domain, 1)):
            return self.intra_node
        return self.network

    def bandwidth(self, link: LinkInfo) -> float:
        return self.eta_comm * link.bytes_per_second


def machine_for_spec(spec: JobSpec, calibration: object | None = None) -> Machine:
    """The machine a spec runs on: the GPU and fabric tables, or on `gpu: cpu` the constants
    measured here (a `ctxlaunch.runtime.calibrate.Calibration`; the tables' placeholders without)."""
    c = spec.cluster
    if c.gpu == "cpu" and calibration is not None:
        return calibration.machine(gpus_per_node=c.gpus_per_node)  # type: ignore[attr-defined]
    return Machine.from_gpu(c.gpu_info, network=spec.fabric.network,
                            gpus_per_node=c.gpus_per_node, nvlink_domain=spec.nvlink_domain,
                            overlap_dp=c.gpu != "cpu")


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step, by term (seconds per step)."""

    terms: dict[str, float]
    step_seconds: float
    tokens_per_second_per_gpu: float
    model_flops_per_second_per_gpu: dict[str, float]
    mfu: dict[str, float]
    detail: dict[str, float] = field(default_factory=dict)
    """Per-layer figures behind the terms (ring hop transfer vs hop compute, ...)."""

    def to_dict(self) -> dict[str, object]:
        return {"step_seconds": self.step_seconds,
                "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
                "model_tflops_per_gpu": {c: v / 1e12 for c, v in
                                         self.model_flops_per_second_per_gpu.items()},
                "mfu": self.mfu, "terms_seconds": self.terms, "detail": self.detail}


def _collective_seconds(volume_bytes: float, steps: int, link: LinkInfo,
                        machine: Machine) -> float:
    if steps <= 0 or volume_bytes <= 0:
        return 0.0
    return volume_bytes / machine.bandwidth(link) + steps * link.latency_seconds


def predict(model: ModelSpec, layout: StepLayout, machine: Machine) -> StepTime:
    """Step time of `layout` on `machine`, term by term (see the module docstring)."""
    L, h, f = model.layers, model.hidden, model.ffn_hidden
    h_kv = model.kv_hidden
    t, p, cp, v = layout.tp, layout.pp, layout.cp, layout.virtual_stages
    u, r = layout.ulysses_degree, layout.ring_degree
    m = layout.grad_accum
    a = 2 if layout.dtype == "bf16" else 4
    n = layout.micro_batch * layout.seq_len / cp  # tokens held by the rank
    layers = L / p
    mode = layout.activation_checkpointing

    # --- compute ------------------------------------------------------------------------------
    attention_weights = 2 * h * h + 2 * h * h_kv
    ffn_weights = 3 * h * f
    counts = count_params(model)
    head_weights = counts.head or counts.embedding
    recompute_weights = {"none": 0, "selective": ffn_weights,
                         "full": attention_weights + ffn_weights}[mode]
    block_matmul = n * layers * (6 * (attention_weights + ffn_weights)
                                 + 2 * recompute_weights) / t
    # The busiest stage: every stage has L/p blocks, the last one also the output head.
    head_matmul = 6 * n * head_weights / t
    matmul_flops = block_matmul + head_matmul
    # Causal attention with balanced (zigzag) sharding: each token attends to s/2 keys on
    # average; forward 4*h*s_keys, backward 8*h*s_keys, a recomputed forward 4 more.
    keys = layout.seq_len / 2
    attention_flops = (n * layers * h * keys * (12 + (4 if mode == "full" else 0)) / t
                       * (1 + machine.causal_tile_tokens / layout.seq_len))
    peak_mm = machine.peak_flops[layout.matmul_precision]
    attention_rate = machine.attention_flops_per_second or (
        machine.eta_attention * machine.peak_flops["bf16" if layout.dtype == "bf16" else "fp32"])
    t_matmul = matmul_flops / (machine.eta_matmul[layout.matmul_precision] * peak_mm)
    t_attention = attention_flops / attention_rate
    # Elementwise traffic of one whole block per token, TP-sharded below (/t): the block's own
    # tensors, not the copies a TP or FSDP2 trainer keeps around it (gathered norm outputs,
    # fp32 residual), which the published runs' frameworks do not make.
    saved = block_activation_bytes_per_token(model, layout.memory().replace(
        activation_checkpointing="none", tp=1, pp=1))
    passes = ELEMENTWISE_HBM_PASSES + {"none": 0.0, "selective": 0.5, "full": 1.0}[mode]
    t_elementwise = n * layers * saved * passes / t / (machine.elementwise_bytes_per_second
                                                      or machine.memory_bytes_per_second)

    # --- TP -------------------------------------------------------------------------------------
    t_tp = 0.0
    if t > 1:
        link = machine.link_for_span(t)
        collectives = 8 + (4 if mode == "full" else 0)
        t_tp = layers * collectives * _collective_seconds((t - 1) / t * n * h * a, t - 1, link,
                                                          machine)

    # --- CP: Ulysses all-to-alls, ring hops against hop compute ---------------------------------
    t_ulysses = 0.0
    if u > 1:
        link = machine.link_for_span(t * u)
        per_layer = 2 * _collective_seconds((u - 1) / u * n * (2 * h + 2 * h_kv) / t * a, u - 1,
                                            link, machine)
        t_ulysses = layers * per_layer * (1.5 if mode == "full" else 1.0)
    t_ring = 0.0
    hop_transfer_fwd = hop_compute_fwd = 0.0
    if r > 1:
        link = machine.link_for_span(t * cp)
        ring_tokens = n * u  # after the Ulysses all-to-all a rank holds s/r tokens of h/u heads
        kv_bytes = 2 * ring_tokens * h_kv / (t * u) * a
        hop_transfer_fwd = _collective_seconds(kv_bytes, 1, link, machine)
        hop_transfer_bwd = _collective_seconds(kv_bytes * (1 + 4 / a), 1, link, machine)
        attention_fwd_layer = t_attention / layers / (3 + (1 if mode == "full" else 0))
        hop_compute_fwd = attention_fwd_layer / r
        exposed_fwd = max(0.0, hop_transfer_fwd - hop_compute_fwd)
        exposed_bwd = max(0.0, hop_transfer_bwd - 2 * hop_compute_fwd)
        forwards = 2 if mode == "full" else 1
        t_ring = layers * (r - 1) * (forwards * exposed_fwd + exposed_bwd)

    micro = t_matmul + t_attention + t_elementwise + t_tp + t_ulysses + t_ring
    forwards = 2 if mode == "full" else 1
    syncs = layers * ((forwards * 4 + 4 if t > 1 else 0) + (2 * forwards + 2 if u > 1 else 0)
                      + ((r - 1) * (forwards + 1) if r > 1 else 0))

    # --- PP -------------------------------------------------------------------------------------
    t_bubble = t_p2p = 0.0
    if p > 1:
        t_bubble = (p - 1) / v * micro
        link = machine.link_for_span(t * cp * layout.dp * p)
        message = n * h / t * a
        t_p2p = 2 * (p - 1) * _collective_seconds(message, 1, link, machine)

    # --- DP / ZeRO over the DP x CP replicas -----------------------------------------------------
    group = layout.dp * cp
    params = params_per_rank(model, t, p)
    t_dp = 0.0
    if group > 1:
        link = machine.link_for_span(t * cp * layout.dp)  # DP ranks are tp x cp apart
        # Across nodes, the group's members in one node reduce there first and then use as
        # many NICs in parallel (NCCL's hierarchical rings).
        in_node = max(1, machine.gpus_per_node // (t * cp))
        bandwidth_scale = in_node if link is machine.network else 1
        grad_bytes = 4 if layout.zero_stage == 0 else a
        share = (group - 1) / group
        if layout.zero_stage == 0:
            volume, steps = 2 * share * params * grad_bytes, 2 * (group - 1)
        elif layout.zero_stage in (1, 2):
            volume, steps = share * params * (grad_bytes + a), 2 * (group - 1)
        else:
            volume = m * share * params * (2 * a + grad_bytes)
            steps = 3 * m * (group - 1)
        t_dp = _collective_seconds(volume / bandwidth_scale, steps, link, machine)
    hide = micro if layout.zero_stage < 3 else m * micro
    t_dp_exposed = max(0.0, t_dp - hide) if machine.overlap_dp else t_dp

    updated = params / group if layout.zero_stage >= 1 else params
    t_optimizer = updated * OPTIMIZER_BYTES_PER_PARAM / machine.memory_bytes_per_second

    terms = {
        "compute_matmul": m * t_matmul,
        "compute_attention": m * t_attention,
        "compute_elementwise": m * t_elementwise,
        "tp_collectives": m * t_tp,
        "ulysses_all_to_all": m * t_ulysses,
        "cp_ring_exposed": m * t_ring,
        "pp_bubble": t_bubble,
        "pp_p2p": t_p2p,
        "dp_collectives_exposed": t_dp_exposed,
        "optimizer": t_optimizer,
        "framework_overhead": m * machine.microbatch_overhead_seconds,
        "sync_overhead": machine.sync_seconds * (m * syncs + (1 if group > 1 else 0)),
    }
    step = sum(terms.values())
    world = layout.world_size
    tokens_per_second = layout.tokens_per_step / step / world
    achieved = {c: tokens_per_second * flops_per_token(model, layout.seq_len, c)
                for c in CONVENTIONS}
    reference = machine.peak_reference_flops or machine.peak_flops["bf16"]
    return StepTime(
        terms=terms, step_seconds=step, tokens_per_second_per_gpu=tokens_per_second,
        model_flops_per_second_per_gpu=achieved,
        mfu={c: achieved[c] / reference for c in CONVENTIONS},
        detail={"ring_hop_transfer_seconds": hop_transfer_fwd,
                "ring_hop_compute_seconds": hop_compute_fwd,
                "dp_collectives_seconds": t_dp,
                "microbatch_seconds": micro},
    )


def predict_spec(spec: JobSpec, machine: Machine | None = None, **changes: object) -> StepTime:
    """`predict` for a validated spec on its own cluster (or `machine`)."""
    return predict(spec.model, StepLayout.from_spec(spec, **changes),
                   machine or machine_for_spec(spec))
