"""The parallel layout of a job: the one record the memory, step-time and communication-volume
models read, the advisor searches over, and the trainer is built from.

A `Layout` is the slice of a spec those models need (the degrees, as the job's one
`ParallelDims`; pipeline split, ZeRO stage, checkpointing, micro-batch, precision, offload and
tiles) plus what only a model needs to know (the matmul precision, whose framework's memory
habits to plan). `Layout.from_spec` reads it from a
validated spec; `overrides` turns it back into `--set` paths, so a spec variant is always
written from the same fields it was read from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import resolve_state_engine
from ctxlaunch.contract.stages import balanced_stage_layers
from ctxlaunch.perf.docbalance import ring_imbalance
from ctxlaunch.perf.flops import document_attention_fraction

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec

ActivationCheckpointing = Literal["none", "selective", "full"]
Framework = Literal["ctxlaunch", "megatron"]
MatmulPrecision = Literal["bf16", "fp8", "fp32"]


@dataclass(frozen=True)
class Layout:
    """How a job is split over its GPUs and run, as the performance models read it."""

    seq_len: int
    dims: ParallelDims = ParallelDims()
    """The degrees, the CP algorithm and sharding: the job's one record of them."""
    micro_batch: int = 1
    grad_accum: int = 1
    stage_layers: tuple[int, ...] = ()
    """Blocks per pipeline stage (pp x virtual stages entries); empty: the balanced split."""
    zero_stage: int = 0
    engine: str = "auto"
    """training.engine: what shards the model states at ZeRO >= 1 (resolved by the spec's
    rule, `contract.spec.resolve_state_engine`, which the trainer reads too)."""
    activation_checkpointing: ActivationCheckpointing = "none"
    dtype: str = "bf16"
    matmul_precision: MatmulPrecision = "bf16"
    """Precision of the weight matmuls; fp8 runs them at twice the BF16 peak."""
    attended_fraction: float = 1.0
    """The share of the causal attention area computed: below 1 under a document mask with a
    known document length (`flops.document_attention_fraction`), else 1. A property of the
    data, not of the split, so `overrides` leaves it out."""
    document_tokens: float | None = None
    """Under a document mask, the token-weighted mean document length (spec
    `data.mean_document_tokens`), from which the step-time model estimates how unevenly a fixed
    CP sharding spreads the masked area (`docbalance.ring_imbalance`); None: unknown or no
    mask. A property of the data, so `overrides` leaves it out."""
    offload_optimizer: bool = False
    """training.offload.optimizer: the optimizer states, fp32 master weights and gradients in
    host memory, stepped there (DeepSpeed's CPU Adam, FSDP2's CPU offload policy)."""
    offload_parameters: bool = False
    """training.offload.parameters: ZeRO-3's parameter partitions in host memory too."""
    offload_activations: bool = False
    """training.offload.activations: each block's checkpointed input in host memory."""
    mlp_tile_tokens: int = 0
    """training.mlp_tile_tokens: the feed-forward over tiles of this many tokens; 0: whole."""
    attention_tile_tokens: int = 0
    """training.attention_tile_tokens: the ring's attention backward over tiles of at most this
    many query and key rows; 0: one kernel call per block."""
    foreach_optimizer: bool = True
    """The optimizer step runs torch's foreach AdamW, which allocates an fp32 temporary for
    every parameter at once; not where the trainer fuses it (training.fused_optimizer: auto
    fuses on CUDA) or steps one tensor at a time (FSDP2's sharded parameters beside the
    experts a rank alone holds). DeepSpeed's engine is always foreach."""
    framework: Framework = "ctxlaunch"
    """Whose memory habits to plan: "ctxlaunch", the bundled trainer (FSDP2 under TP or PP keeps
    fp32 weights and an fp32 residual under autocast; its TP keeps the gathered norm outputs
    for backward), or "megatron", for runs published from Megatron-LM/NeMo (bf16 weights with
    the fp32 master copy in the distributed optimizer, and sequence parallelism that
    re-gathers a projection's input in backward rather than keeping it)."""

    @classmethod
    def from_spec(cls, spec: JobSpec) -> Layout:
        """The layout a validated spec runs with."""
        t = spec.training
        return cls(
            seq_len=t.seq_len,
            dims=spec.parallel_dims,
            micro_batch=t.micro_batch,
            grad_accum=spec.grad_accum,
            stage_layers=spec.stage_layers,
            zero_stage=t.zero_stage,
            engine=t.engine,
            activation_checkpointing=t.activation_checkpointing,
            offload_optimizer=t.offload.optimizer,
            offload_parameters=t.offload.parameters,
            offload_activations=t.offload.activations,
            mlp_tile_tokens=t.mlp_tile_tokens or 0,
            attention_tile_tokens=t.attention_tile_tokens or 0,
            dtype=spec.model.dtype,
            matmul_precision="bf16" if spec.model.dtype == "bf16" else "fp32",
            attended_fraction=(
                document_attention_fraction(t.seq_len, t.data.mean_document_tokens)
                if t.data.document_mask and t.data.mean_document_tokens
                else 1.0
            ),
            document_tokens=(
                float(t.data.mean_document_tokens)
                if t.data.document_mask and t.data.mean_document_tokens
                else None
            ),
            foreach_optimizer=_foreach_optimizer(spec),
        )

    def replace(self, **changes: Any) -> Layout:
        """This layout with some fields changed."""
        return dataclasses.replace(self, **changes)

    def with_dims(self, **changes: Any) -> Layout:
        """This layout with some degrees (or the CP algorithm or sharding) changed."""
        return dataclasses.replace(self, dims=self.dims.replace(**changes))

    def overrides(self) -> dict[str, Any]:
        """The spec fields (`--set` paths) that make a spec run this layout. None clears a field
        the layout determines otherwise (the ring degree follows from cp and the Ulysses
        degree, grad_accum from the global batch)."""
        d = self.dims
        hybrid = d.cp_algorithm == "hybrid"
        return {
            "parallel.tp": d.tp,
            "parallel.pp": d.pp,
            "parallel.cp": d.cp,
            "parallel.ep": d.ep,
            "parallel.dp": d.dp,
            "parallel.cp_algorithm": d.cp_algorithm,
            "parallel.ulysses_degree": d.ulysses_degree if hybrid else None,
            "parallel.ring_degree": None,
            "parallel.virtual_stages": d.virtual_stages,
            "parallel.stage_layers": list(self.stage_layers) if self.stage_layers else None,
            "parallel.cp_sharding": d.cp_sharding,
            "training.seq_len": self.seq_len,
            "training.micro_batch": self.micro_batch,
            "training.global_batch": self.micro_batch * self.grad_accum * d.dp,
            "training.grad_accum": None,
            "training.zero_stage": self.zero_stage,
            "training.engine": self.engine,
            "training.activation_checkpointing": self.activation_checkpointing,
            "training.offload.optimizer": self.offload_optimizer,
            "training.offload.parameters": self.offload_parameters,
            "training.offload.activations": self.offload_activations,
            "training.mlp_tile_tokens": self.mlp_tile_tokens or None,
            "training.attention_tile_tokens": self.attention_tile_tokens or None,
            "model.dtype": self.dtype,
        }

    def apply_to(self, spec: JobSpec) -> JobSpec:
        """`spec` with this layout's fields set, not re-validated (`layout_problems` is the
        check a caller runs on it)."""
        tree: dict[str, Any] = {}
        for path, value in self.overrides().items():
            *sections, name = path.split(".")
            node = tree
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
        return _copy_with(spec, tree)

    # ----------------------------------------------------------------------------------------
    # what the models derive from it
    # ----------------------------------------------------------------------------------------
    @property
    def attention_tile_fraction(self) -> float:
        """The share of its shard's rows one attention kernel call of the ring's backward
        covers: below 1 under `attention_tile_tokens` shorter than what the inner ring holds
        (the CP shard's tokens times the Ulysses degree); 1 without a ring or tiles."""
        if not self.attention_tile_tokens or self.dims.ring_degree == 1:
            return 1.0
        ring_rows = self.tokens_per_rank * self.dims.ulysses_degree
        return min(1.0, self.attention_tile_tokens / ring_rows)

    @property
    def attention_imbalance(self) -> float:
        """The busiest ring rank's attention area over the mean: above 1 under a document
        mask with zigzag or contiguous shards, 1 with the balanced sharding, without a ring,
        or without a known document length (`docbalance.ring_imbalance`)."""
        return ring_imbalance(
            self.seq_len, self.dims.ring_degree, self.dims.cp_sharding, self.document_tokens
        )

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum * self.dims.dp

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one micro-batch held by one rank (sequence split by CP)."""
        return self.micro_batch * self.seq_len // self.dims.cp

    def rank_layers(self, layers: int) -> list[int]:
        """Blocks each PP rank holds (rank r holds stages r, r + pp, ... when interleaved)."""
        pp = self.dims.pp
        if not self.stage_layers:
            return default_rank_layers(layers, pp)
        held = [0] * pp
        for stage, count in enumerate(self.stage_layers):
            held[stage % pp] += count
        return held

    @property
    def fsdp(self) -> bool:
        """The bundled trainer shards model states with FSDP2 (training.engine, resolved)."""
        return (
            self.framework == "ctxlaunch"
            and resolve_state_engine(
                self.engine, self.zero_stage, tp=self.dims.tp, pp=self.dims.pp, ep=self.dims.ep
            )
            == "fsdp2"
        )

    @property
    def fsdp_sharded(self) -> bool:
        """FSDP2 with more than one rank to shard over (DP x CP > 1); with one, the trainer
        keeps plain fp32 states."""
        return self.fsdp and self.dims.shard_group > 1

    @property
    def fsdp_bf16_params(self) -> bool:
        """FSDP2 in bf16 over more than one rank: a mixed-precision policy gathers bf16
        parameters (the fp32 masters stay sharded, in the optimizer's hands) and reduces
        gradients in fp32, so no fp32 weight is used in compute."""
        return self.fsdp_sharded and self.dtype == "bf16"

    @property
    def fp32_weights(self) -> bool:
        """fp32 weights with bf16 compute through autocast: ZeRO-0, and FSDP2 where it has
        nothing to shard over (one rank per slice: plain fp32 states)."""
        if self.framework == "megatron":
            return False
        return self.zero_stage == 0 or (self.fsdp and not self.fsdp_bf16_params)

    @property
    def offloads(self) -> bool:
        """Whether anything is offloaded to host memory."""
        return self.offload_optimizer or self.offload_parameters or self.offload_activations

    def describe_memory_settings(self) -> str:
        """The offload and tiling switches in one phrase ("" when none is on)."""
        moved = [
            name
            for name, on in (
                ("optimizer", self.offload_optimizer),
                ("parameters", self.offload_parameters),
                ("activations", self.offload_activations),
            )
            if on
        ]
        parts = [f"offload {'+'.join(moved)}"] if moved else []
        if self.mlp_tile_tokens:
            parts.append(f"MLP tiles {self.mlp_tile_tokens:,}")
        if self.attention_tile_tokens:
            parts.append(f"attention tiles {self.attention_tile_tokens:,}")
        return ", ".join(parts)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return 2 if self.dtype == "bf16" else 4

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream."""
        # ZeRO-0 bf16 runs under autocast: fp32 weights, so the residual stream stays fp32
        # (FSDP2's bf16 parameters make it bf16, as DeepSpeed's bf16 module does).
        return 4 if self.dtype == "fp32" or self.fp32_weights else 2


def _foreach_optimizer(spec: JobSpec) -> bool:
    """Whether the trainer's optimizer step is foreach AdamW (see `Layout.foreach_optimizer`):
    DeepSpeed's always; torch's unless fused (auto: on CUDA) or one tensor at a time (FSDP2
    sharding the dense states beside experts each rank holds alone)."""
    t, dims = spec.training, spec.parallel_dims
    if spec.state_engine == "deepspeed":
        return True
    fused = spec.cluster.gpu != "cpu" if t.fused_optimizer == "auto" else bool(t.fused_optimizer)
    alone = (
        spec.model.moe is not None
        and spec.state_engine == "fsdp2"
        and dims.shard_group > 1
        and dims.expert_shard_group == 1
    )
    return not fused and not alone


def default_rank_layers(layers: int, pp: int) -> list[int]:
    """Blocks per PP rank when the layout names no split: the balanced split a validated spec
    gets (ctxlaunch.contract.stages), so a layout that never went through a spec (advise's
    candidates, a published run) is planned as it would run. Llama 3 405B at PP 16: 7, 8 x 14,
    7, not 7 x 16."""
    if layers < pp:  # no legal split; the validator names the error, the plan stays defined
        return [1] * pp
    return list(balanced_stage_layers(layers, pp))


def _copy_with(model: Any, changes: dict[str, Any]) -> Any:
    """`model` (a spec section) with `changes` set, a nested mapping entering the sub-section
    of its name (training.offload)."""
    update = {
        name: _copy_with(getattr(model, name), value) if isinstance(value, dict) else value
        for name, value in changes.items()
    }
    return model.model_copy(update=update)
