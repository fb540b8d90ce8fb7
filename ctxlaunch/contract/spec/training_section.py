"""The training section of the job spec: the optimizer, checkpoints, the data, evaluation, and
what one optimizer step looks like; and the rule that resolves what keeps the model states."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from ctxlaunch.contract.spec.fields import SEED_MAX, PositiveInt, _problem, _Strict


class OptimizerSpec(_Strict):
    """AdamW (decoupled weight decay) with linear warm-up then cosine decay."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of lr, reached at the last step."""
    warmup_steps: int = Field(0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables it."""


class CheckpointSpec(_Strict):
    """Distributed checkpoints (torch.distributed.checkpoint); resume is automatic."""

    dir: str | None = None
    """Where checkpoints go (shared by all ranks). None disables checkpointing."""
    interval: int = Field(100, ge=1)
    """Save every this many steps (and on a preemption signal)."""
    keep: int = Field(2, ge=1)
    """Keep the newest this many checkpoints."""


def indexed_prefix(path: str | Path) -> Path:
    """A Megatron indexed dataset's file prefix: `path` may name the prefix, the .bin or the
    .idx; the data is PREFIX.bin and its index PREFIX.idx."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".bin", ".idx") else path


def indexed_files(path: str | Path) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx) for an indexed dataset named as `indexed_prefix` takes it."""
    prefix = indexed_prefix(path)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


def loss_mask_file(path: str | Path) -> Path:
    """PREFIX.lossmask: beside an indexed dataset, one byte per token of PREFIX.bin, in its
    order, 1 where the token is a target the loss counts (what `data prepare --chat` writes)."""
    prefix = indexed_prefix(path)
    return prefix.with_name(prefix.name + ".lossmask")


class DataSpec(_Strict):
    """Training tokens: synthetic (seeded random tokens), a text file read byte-level, or
    tokenized documents (Megatron indexed datasets, as `ctxlaunch data prepare` writes)."""

    source: Literal["synthetic", "text", "tokens"] = "synthetic"
    """synthetic: seeded random tokens; text: `path` read byte-level; tokens: `path` or
    `paths`, indexed datasets packed into sequences at fixed offsets."""
    path: str | None = None
    """The text file for source: text; each byte is one token (vocab >= 256). For source:
    tokens, one indexed dataset: its prefix, .bin or .idx."""
    paths: list[str] | None = None
    """source: tokens only: several indexed datasets, blended by `weights`."""
    weights: list[Annotated[float, Field(gt=0)]] | None = None
    """One positive weight per entry of `paths` (normalised to sum 1): the share of sequences
    drawn from each. Default: equal shares."""
    eval_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """source: tokens only: the fraction of each file's documents held out for evaluation,
    chosen by a fixed hash of the document's index (never trained on)."""
    document_mask: bool = False
    """source: tokens only: attention never crosses a document boundary inside a packed
    sequence (under every CP algorithm and layout; pairs of shards that share no document are
    skipped, not computed), and a token whose target opens the next document is not predicted
    (its target is ignored, -100). The loss is the mean over the predicted tokens of the step."""
    loss_mask: bool = False
    """source: tokens only: the loss counts only the targets that each dataset's
    PREFIX.lossmask marks (supervised fine-tuning: `ctxlaunch data prepare --chat` marks the
    assistant's tokens), the mask staying aligned with its tokens through packing, document
    masks and every CP, TP and PP split. The loss, and evaluation's, is the mean over every
    supervised target of the step (the count summed over DP and CP), never a mean per rank."""
    restart_positions: bool = True
    """With document_mask: positions (RoPE) restart at 0 at each document, so each document is
    computed exactly as if it ran alone, which is what Hugging Face's packing with position ids
    (DataCollatorWithFlattening) and varlen flash-attention training do. false keeps the global
    positions of the packed sequence, as Llama 3's long-context stage reports."""
    mean_document_tokens: PositiveInt | None = None
    """With document_mask, for the planner's attention cost: the token-weighted mean document
    length (sum of squared lengths over the sum of lengths: the length of the document an
    average token belongs to; `ctxlaunch.perf.flops.token_weighted_document_tokens` computes it
    from a dataset's document lengths). Unset: attention is costed as unmasked causal."""

    @model_validator(mode="after")
    def _path_for_text(self) -> DataSpec:
        if self.source == "text" and not self.path:
            raise ValidationError.from_exception_data(
                "DataSpec",
                [
                    _problem(
                        ("path",),
                        self.path,
                        "data.source = text needs data.path (the text file to read byte-level)",
                    )
                ],
            )
        return self

    @model_validator(mode="after")
    def _files_for_tokens(self) -> DataSpec:
        problems: list[InitErrorDetails] = []
        if self.source != "tokens":
            for name in ("paths", "weights"):
                if getattr(self, name) is not None:
                    problems.append(
                        _problem(
                            (name,), getattr(self, name), f"data.{name} needs data.source = tokens"
                        )
                    )
            if self.loss_mask:
                problems.append(
                    _problem(
                        ("loss_mask",),
                        self.loss_mask,
                        f"data.loss_mask needs data.source = tokens (an indexed dataset with "
                        f"its PREFIX.lossmask); source {self.source} has none",
                    )
                )
            if self.document_mask:
                problems.append(
                    _problem(
                        ("document_mask",),
                        self.document_mask,
                        f"data.document_mask needs data.source = tokens (documents packed into "
                        f"sequences); source {self.source} has no documents",
                    )
                )
        elif (self.path is None) == (self.paths is None):
            problems.append(
                _problem(
                    ("path",),
                    self.path,
                    "data.source = tokens needs exactly one of data.path (one indexed dataset) "
                    "and data.paths (several, with data.weights)",
                )
            )
        elif self.weights is not None and (
            self.paths is None or len(self.weights) != len(self.paths)
        ):
            problems.append(
                _problem(
                    ("weights",),
                    self.weights,
                    f"data.weights has {len(self.weights)} entries but data.paths has "
                    f"{len(self.paths or [])}: give one weight per path",
                )
            )
        if self.mean_document_tokens is not None and not self.document_mask:
            problems.append(
                _problem(
                    ("mean_document_tokens",),
                    self.mean_document_tokens,
                    "data.mean_document_tokens costs a document mask: it needs "
                    "data.document_mask: true",
                )
            )
        if problems:
            raise ValidationError.from_exception_data("DataSpec", problems)
        return self

    def missing_files(self) -> list[str]:
        """Each data file missing from the local filesystem, as "training.data.<field>: <why>".
        Not a validation error: a spec is rendered and submitted where the data may not be (a
        login node, a laptop); the trainer refuses to start without it, and validation warns."""
        out = []
        if self.source == "text" and self.path is not None and not Path(self.path).is_file():
            out.append(f"training.data.path {self.path}: no such file")
        if self.source == "tokens":
            entries = (
                [("path", str(self.path))]
                if self.paths is None
                else [(f"paths[{i}]", p) for i, p in enumerate(self.paths)]
            )
            for name, value in entries:
                files = [*indexed_files(value)] + (
                    [loss_mask_file(value)] if self.loss_mask else []
                )
                missing = [str(f) for f in files if not f.is_file()]
                if missing:
                    command = "ctxlaunch data prepare" + (" --chat" if self.loss_mask else "")
                    out.append(
                        f"training.data.{name} {value}: no such file: "
                        f"{', '.join(missing)} (make it with `{command}`)"
                    )
        return out


class PasskeySpec(_Strict):
    """The passkey-retrieval probe (Mohtashami & Jaggi, 2023): a random number hidden at a
    given depth in filler text, asked for at the end; scored by whether the model's arg-max
    reproduces every token of the number (teacher-forced, so one forward pass per probe)."""

    enabled: bool = True
    lengths: list[PositiveInt] | None = None
    """Prompt lengths in tokens (each at most training.seq_len). Default: seq_len / 4,
    seq_len / 2 and seq_len."""
    depths: list[Annotated[float, Field(ge=0.0, le=1.0)]] = [0.0, 0.25, 0.5, 0.75, 1.0]
    """Where the number sits in the filler: 0 at the start, 1 just before the question."""
    trials: PositiveInt = 2
    """Different numbers per (length, depth)."""

    @model_validator(mode="after")
    def _grid(self) -> PasskeySpec:
        lengths = len(self.lengths) if self.lengths is not None else 3
        probes = lengths * len(self.depths) * self.trials
        if self.enabled and probes > MAX_PASSKEY_PROBES:
            raise ValueError(
                f"{lengths} lengths x {len(self.depths)} depths x {self.trials} trials make "
                f"{probes:,} probes, one forward pass each at every evaluation; at most "
                f"{MAX_PASSKEY_PROBES:,}"
            )
        return self


MAX_PASSKEY_PROBES = 1000
"""The most passkey probes an evaluation runs (lengths x depths x trials): each is a forward
pass of up to seq_len tokens; the default grid is 30."""
MAX_EVAL_SEQUENCES = 1000
"""The most held-out sequences an evaluation scores (the default is 8)."""
MAX_EVAL_BUCKETS = 64
"""The most context-length buckets: they halve seq_len, which has at most 63 halvings."""


class EvalSpec(_Strict):
    """Evaluation at length on held-out data (`ctxlaunch eval`, and every `interval` steps
    during training): loss and perplexity per context-length bucket, and the passkey probe.
    Runs forward only, at the job's own layout (pp 1)."""

    interval: int = Field(0, ge=0)
    """Evaluate every this many training steps; 0: only through `ctxlaunch eval`."""
    sequences: int = Field(8, ge=1, le=MAX_EVAL_SEQUENCES)
    """Held-out sequences of seq_len tokens to score (fewer if the held-out data is shorter;
    at most 1,000: each is a forward pass, and all are held at once)."""
    buckets: int = Field(6, ge=1, le=MAX_EVAL_BUCKETS)
    """Context-length buckets, doubling up to seq_len: with 6 at 8,192 tokens the buckets are
    [0, 256), [256, 512), ... [4096, 8192). A token's context length is its position (the
    RoPE position: in its document when positions restart per document)."""
    tokenizer: str | None = None
    """The tokenizer of the data (tokenizer.json, a SentencePiece model or a tiktoken file),
    for the passkey prompts on source: tokens; byte-level text needs none."""
    passkey: PasskeySpec = PasskeySpec()


class OffloadSpec(_Strict):
    """What moves from the GPU to the node's host memory to make room for a longer sequence
    (Arctic Long Sequence Training's recipe). Each switch costs copies over the GPU's host link
    (PCIe), which `plan` charges in the predicted step, and host memory, which `plan` checks
    against `cluster.host_memory_gib`."""

    optimizer: bool = False
    """The optimizer's states, with the fp32 master weights and gradients they update, kept
    and stepped in host memory: DeepSpeed's ZeRO-Offload with its CPU Adam under engine
    deepspeed (the cpu_adam op is compiled on first use), FSDP2's CPU offload policy under
    engine fsdp2 (the sharded fp32 parameters, their gradients and AdamW's states on the
    host, AdamW stepping there). Needs zero_stage >= 1."""
    parameters: bool = False
    """The parameters too: DeepSpeed's ZeRO-3 parameter offload (the 16-bit partitions in host
    memory, fetched to the GPU layer by layer). Needs zero_stage 3 and optimizer: true; under
    FSDP2 the optimizer switch already keeps the sharded parameters on the host, and ZeRO-3
    gathers only two blocks' at a time."""
    activations: bool = False
    """Each block's checkpointed input copied to host memory (pinned on CUDA) in forward, and
    brought back on a side stream while the block after it runs its backward, so the copy
    overlaps compute; the device keeps the last block's and the one in flight. Needs
    activation_checkpointing: full and pp 1."""

    @property
    def any(self) -> bool:
        """Whether anything is offloaded."""
        return self.optimizer or self.parameters or self.activations


HealChange = Literal[
    "cp", "cp_algorithm", "activation_checkpointing", "zero_stage", "tp", "pp", "micro_batch", "ep"
]
"""What a re-plan may change of the layout (never the global batch, the sequence length or the
data order: the run stays the same run)."""

HEAL_CHANGES: tuple[HealChange, ...] = (
    "cp",
    "cp_algorithm",
    "activation_checkpointing",
    "zero_stage",
    "tp",
    "pp",
    "micro_batch",
    "ep",
)

MAX_REPLANS = 20
"""The most re-plans a job may ask for: each costs a restart, and a layout that needs more has a
problem no layout solves."""


class HealSpec(_Strict):
    """A job that heals itself: after an out-of-memory, or when it starts on a different
    allocation than it asked for, every rank agrees on the planner's fastest layout that fits
    what the job has and resumes there from the newest checkpoint. Off by default (both policies
    leave the job as it is). It needs training.checkpoint.dir, and checkpoints that resume at
    any layout (ZeRO-0 or FSDP2: not DeepSpeed's)."""

    on_oom: Literal["stop", "replan"] = "stop"
    """stop: an out-of-memory ends the job (exit 86, the layout that caused it in `status`).
    replan: the job restarts (Slurm requeues it, the PyTorchJob's pod is replaced, the local
    launcher runs it again) from its newest checkpoint at the fastest layout that fits the same
    GPUs with the measured peak taken into account: the measured over the predicted peak raises
    the planner's margin for this job, and a layout that ran out of memory is never chosen
    again. A CPU rank the kernel's OOM killer ends under a memory limit (Slurm --mem, a pod's
    memory limit) counts the same."""
    on_allocation_change: Literal["wait", "replan"] = "wait"
    """wait: the job runs only on the nodes it asked for (cluster.nodes). replan: it asks for
    min_nodes to cluster.nodes (Slurm --nodes=MIN-MAX, a PyTorchJob elasticPolicy) and starts on
    what it gets: where its own layout does not fit that, every rank agrees on the planner's
    fastest layout for it and resumes there; when a later restart gets more nodes back, it
    grows back (its own layout on its own allocation)."""
    min_nodes: PositiveInt | None = None
    """on_allocation_change replan: the fewest nodes the job may run on (default 1); at most
    cluster.nodes."""
    max_replans: int = Field(3, ge=1, le=MAX_REPLANS)
    """Re-plans allowed over the whole job (1 to 20); the next fault then ends it as without
    training.heal."""
    may_change: list[HealChange] = list(HEAL_CHANGES)
    """What a re-plan may change: cp, cp_algorithm, activation_checkpointing, zero_stage, tp,
    pp, micro_batch, ep (a mixture of experts' expert parallel degree); default all. The
    data-parallel degree follows from the GPUs and the rest; the global batch, the sequence
    length and the data order never change."""

    @property
    def enabled(self) -> bool:
        """Whether any fault re-plans the job."""
        return self.on_oom == "replan" or self.on_allocation_change == "replan"

    @property
    def elastic(self) -> bool:
        """Whether the job may start on fewer nodes than it asks for."""
        return self.on_allocation_change == "replan"

    def fewest_nodes(self, nodes: int) -> int:
        """The fewest nodes a job of `nodes` nodes may run on under this policy."""
        return min(self.min_nodes or 1, nodes) if self.elastic else nodes

    @model_validator(mode="after")
    def _min_nodes_needs_replan(self) -> HealSpec:
        if self.min_nodes is not None and not self.elastic:
            raise ValidationError.from_exception_data(
                "HealSpec",
                [
                    _problem(
                        ("min_nodes",),
                        self.min_nodes,
                        "heal.min_nodes is the fewest nodes a changed allocation may bring: "
                        "it needs heal.on_allocation_change: replan",
                    )
                ],
            )
        return self


class TrainingSpec(_Strict):
    """What one optimizer step looks like and how long to run."""

    seq_len: PositiveInt
    """Tokens per sequence (the whole sequence; CP splits it across ranks)."""
    micro_batch: PositiveInt = 1
    """Sequences per rank per forward/backward."""
    global_batch: PositiveInt | None = None
    """Sequences per optimizer step over all data-parallel replicas. Give this or grad_accum."""
    grad_accum: PositiveInt | None = None
    """Micro-batches per optimizer step per rank. Derived from global_batch when not given."""
    steps: PositiveInt = 100
    """Optimizer steps to run. With `tokens` given, derived from it (a different number given
    too is overridden, with a warning)."""
    tokens: PositiveInt | None = None
    """A token budget: train this many tokens, that is ceil(tokens / tokens per step) optimizer
    steps (tokens per step = global batch x seq_len). `plan`, `advise` and `sweep` give the
    time, GPU-hours, energy and cost of the whole run from it (or from `steps`)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """none: keep all activations; selective: recompute each block's feed-forward half (cheap,
    linear in s) and keep attention (quadratic to recompute); full: keep only each block's input
    and recompute the block in backward."""
    zero_stage: int = Field(0, ge=0, le=3)
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters, each sharded
    over the DP x CP ranks (by `engine`)."""
    engine: Literal["auto", "fsdp2", "deepspeed"] = "auto"
    """What shards the model states for zero_stage >= 1. fsdp2: torch FSDP2 over DP x CP, at
    any layout, checkpoints that resume at any TP, PP, CP, DP and EP degree. deepspeed:
    DeepSpeed ZeRO, at TP 1 x PP 1 only (with ep > 1: ZeRO-1 or ZeRO-2, the experts' states
    sharded over the ranks holding the same experts), checkpoints in DeepSpeed's own format
    (they resume only at the same layout). auto: deepspeed at TP 1 x PP 1 and ep 1, fsdp2
    otherwise. ZeRO-0 is plain torch whatever this says (`JobSpec.state_engine` resolves
    it)."""
    offload: OffloadSpec = OffloadSpec()
    """What moves to host memory (see OffloadSpec); nothing by default."""
    mlp_tile_tokens: PositiveInt | None = None
    """The feed-forward half of each block (its RMSNorm, gate/up and down projections and
    SwiGLU) computed over tiles of this many of the rank's tokens, in forward and again in
    backward, so its (tokens x ffn) intermediates exist for one tile at a time and only its
    input is kept for backward: one more feed-forward pass per step. Arctic Long Sequence
    Training tiles at about the hidden size. None: the feed-forward runs whole."""
    attention_tile_tokens: PositiveInt | None = None
    """The ring attention's backward (ring and hybrid CP) computed over tiles of at most this
    many query rows and this many key rows, each tile's gradients added into the block's, so
    the kernels' gradient buffers and accumulators grow with the tile, not with the rank's
    shard. Exact (the same sums in another order). Worth it where a rank holds several tiles'
    worth of tokens; None: one kernel call per ring block."""
    optimizer: OptimizerSpec = OptimizerSpec()
    seed: int = Field(0, ge=0, le=SEED_MAX)
    """Seeds the weights' initialisation, the synthetic data and the passkey numbers (at most
    2^32 - 1)."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    data: DataSpec = DataSpec()
    eval: EvalSpec = EvalSpec()
    log_interval: PositiveInt = 1
    """Log (and export) metrics every this many steps."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each block's pointwise work (RMSNorm, RoPE, SwiGLU and the fp32 math of
    their backward passes; attention and the matmuls stay as they are). auto: on for CUDA, off
    on the CPU (where inductor needs a C++ compiler and tens of seconds per shape); true or
    false forces it. Compiled and eager agree within fp32 rounding."""
    fused_optimizer: bool | Literal["auto"] = "auto"
    """AdamW as one fused kernel per step (`torch.optim.AdamW(fused=True)`) instead of
    `foreach`. auto: fused on CUDA, foreach on the CPU; true or false forces it (torch fuses on
    the CPU too). The DeepSpeed engine always uses foreach (its path is unchanged)."""
    timeout_seconds: int = Field(600, ge=5)
    """How long a collective waits for its peers: a dead or hung rank ends the job with an
    error within this time, never a hang."""
    heal: HealSpec = HealSpec()
    """Self-healing after an out-of-memory or on a changed allocation (off by default)."""

    def grad_accum_at(self, dp: int) -> int:
        """Micro-batches per optimizer step per rank at data-parallel degree `dp`: grad_accum
        as given, else derived from global_batch, else 1."""
        if self.grad_accum is not None:
            return self.grad_accum
        if self.global_batch is not None:
            return self.global_batch // (self.micro_batch * dp)
        return 1


StateEngine = Literal["torch", "fsdp2", "deepspeed"]
"""torch: every rank keeps whole fp32 states of its slice (ZeRO-0); fsdp2: FSDP2 shards them
over DP x CP; deepspeed: DeepSpeed ZeRO does (bf16 weights, fp32 master copy)."""


def resolve_state_engine(
    engine: str, zero_stage: int, *, tp: int, pp: int, ep: int = 1
) -> StateEngine:
    """The engine `training.engine` means at this ZeRO stage and layout (see TrainingSpec):
    auto is DeepSpeed at TP 1 x PP 1 without expert parallelism (FSDP2's checkpoints of
    experts resume at another EP degree, DeepSpeed's only at the same layout), FSDP2
    otherwise."""
    if zero_stage == 0:
        return "torch"
    if engine == "deepspeed" or (engine == "auto" and tp == 1 and pp == 1 and ep == 1):
        return "deepspeed"
    return "fsdp2"
