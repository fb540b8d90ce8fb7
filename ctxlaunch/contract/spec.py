"""The job spec: one validated document describing a long-context training job.

Field-level rules live on the fields; rules that tie fields together (the parallel layout
against the model and the cluster) live in `JobSpec._check_layout`, which reports every broken
rule at once, each at the field it concerns, with the value, the rule and a fix.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from ctxlaunch.contract.hardware import GpuInfo, GpuType, NetworkType, gpu_info
from ctxlaunch.contract.hfconfig import CONFIG_FILE, HFConfigError, model_fields
from ctxlaunch.contract.presets import MODEL_PRESETS
from ctxlaunch.contract.stages import balanced_stage_layers

PROFILE_FORMAT = "ctxlaunch-machine-profile/1"
"""The `format` of a machine profile file (ctxlaunch.perf.machine.save_profile)."""

RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
RFC1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Values that land on `#SBATCH` lines are parsed by sbatch, not by bash, so they are restricted
# to characters that need no quoting rather than quoted.
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
SLURM_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{2}){0,2}|\d+(:\d{2}){0,2})$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
IMAGE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:@]*$")

# Pod names are "<job>-master-0" / "<job>-worker-<n>" and must stay within 63 characters.
MAX_JOB_NAME = 48

PositiveInt = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    """Unknown fields are errors: a typo must never be silently ignored.

    The docstring under each field is its description in the JSON Schema. json_schema() reads
    them when it is asked for the schema: pydantic's use_attribute_docstrings reads each
    class's source while the module is imported, a fifth of this module's import time, paid
    by every command (see BENCHMARKS.md section 5b)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _problem(loc: tuple[str | int, ...], value: Any, message: str) -> InitErrorDetails:
    return InitErrorDetails(
        type=PydanticCustomError("layout", "{message}", {"message": message}),
        loc=loc,
        input=value,
    )


def problem_message(detail: InitErrorDetails) -> str:
    """The text of a problem made by `_problem`."""
    kind = detail["type"]
    return kind.message() if isinstance(kind, PydanticCustomError) else str(kind)


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
class DefaultRope(_Strict):
    """Plain RoPE: inverse frequencies theta^(-2i/d)."""

    type: Literal["default"] = "default"


class LinearRope(_Strict):
    """Position interpolation: every inverse frequency divided by `factor`."""

    type: Literal["linear"] = "linear"
    factor: float = Field(ge=1)
    """How many times the context is stretched."""


class Llama3Rope(_Strict):
    """Llama 3.1's scaling: low frequencies divided by `factor`, high ones kept, the band
    between interpolated smoothly (transformers' `_compute_llama3_parameters`)."""

    type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, ge=1)
    """Division of the low frequencies (8 in Llama 3.1)."""
    low_freq_factor: float = Field(1.0, gt=0)
    """Wavelengths above original_max_position_embeddings / low_freq_factor are scaled."""
    high_freq_factor: float = Field(4.0, gt=0)
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: PositiveInt = 8192
    """The context length the model was pretrained at (8192 in Llama 3.1)."""

    @model_validator(mode="after")
    def _band(self) -> Llama3Rope:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor = {self.high_freq_factor} must exceed "
                f"low_freq_factor = {self.low_freq_factor}"
            )
        return self


class YarnRope(_Strict):
    """YaRN (transformers' `_compute_yarn_parameters`): frequencies blended between
    interpolation and extrapolation by a ramp between the beta_fast and beta_slow rotation
    counts, and cos/sin multiplied by an attention factor."""

    type: Literal["yarn"] = "yarn"
    factor: float = Field(ge=1)
    """How many times the context is stretched."""
    original_max_position_embeddings: PositiveInt
    """The context length the model was pretrained at."""
    beta_fast: float = Field(32.0, gt=0)
    """Rotations below which a dimension is interpolated fully."""
    beta_slow: float = Field(1.0, gt=0)
    """Rotations above which a dimension is extrapolated (kept)."""
    attention_factor: float | None = Field(None, gt=0)
    """The cos/sin multiplier; default 0.1 ln(factor) + 1 (or the mscale ratio)."""
    mscale: float | None = None
    """With mscale_all_dim, the default attention factor is
    (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1) (DeepSeek's form)."""
    mscale_all_dim: float | None = None
    """See mscale."""
    truncate: bool = True
    """Round the ramp's ends to whole dimensions (transformers' default)."""


RopeScaling = Annotated[
    DefaultRope | LinearRope | Llama3Rope | YarnRope, Field(discriminator="type")
]
"""RoPE frequency scaling, as transformers computes it, chosen by `type`."""

SHAPE_FIELDS = (
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "vocab",
    "norm_eps",
    "tie_embeddings",
)
"""What `init_from`'s config.json fixes: a spec may repeat these, but must agree."""


class ModelSpec(_Strict):
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

    preset: str | None = None
    """Start from a named shape (see `ctxlaunch.contract.presets`); fields given beside it override it."""
    init_from: str | None = None
    """A Hugging Face Llama checkpoint directory (config.json and model.safetensors, or shards
    with model.safetensors.index.json): the shape, norm_eps, tie_embeddings, rope_theta and
    rope_scaling come from its config.json, and training starts from its weights (each rank
    reads only the slice it holds). Shape fields given beside it must agree with config.json;
    rope_theta and rope_scaling given beside it override it (to extend the context)."""
    layers: PositiveInt
    """Transformer blocks."""
    hidden: PositiveInt
    """Model width h."""
    heads: PositiveInt
    """Query heads; head_dim = hidden / heads."""
    kv_heads: PositiveInt
    """Key/value heads (GQA); must divide heads."""
    ffn_hidden: PositiveInt
    """SwiGLU inner width."""
    vocab: PositiveInt
    """Vocabulary size (byte-level text data needs at least 256)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Training precision: bf16 (mixed precision with fp32 master weights) or plain fp32."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    rope_scaling: RopeScaling = DefaultRope()
    """RoPE frequency scaling: {type: default}, {type: linear, factor}, {type: llama3, factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings} (Llama 3.1) or
    {type: yarn, factor, original_max_position_embeddings, beta_fast, beta_slow,
    attention_factor, ...}, computed as transformers does."""
    norm_eps: float = Field(1e-5, gt=0)
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"preset": data}
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if name not in MODEL_PRESETS:
                raise PydanticCustomError(
                    "preset",
                    "{message}",
                    {
                        "message": (
                            f"unknown model preset {name!r}; known presets: "
                            + ", ".join(sorted(MODEL_PRESETS))
                        )
                    },
                )
            data = {**MODEL_PRESETS[name], **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _apply_init_from(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("init_from") is None:
            return data
        directory = str(data["init_from"])
        where = str(Path(directory) / CONFIG_FILE)
        if data.get("preset") is not None:
            raise PydanticCustomError(
                "init_from",
                "{message}",
                {
                    "message": (
                        f"give model.preset or model.init_from, not both (init_from {directory!r} "
                        "fixes the shape)"
                    )
                },
            )
        required = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")
        if not (Path(directory) / CONFIG_FILE).exists() and all(
            data.get(name) is not None for name in required
        ):
            # Not on this machine (a login node renders a job whose checkpoint lives on the
            # cluster): the spec's own shape stands here; validation warns, and the trainer,
            # where the directory is, validates again against its config.json.
            return data
        try:
            fields = model_fields(directory)
        except HFConfigError as exc:
            raise PydanticCustomError("init_from", "{message}", {"message": str(exc)}) from None
        for name in SHAPE_FIELDS:
            given = data.get(name)
            if given is not None and given != fields[name]:
                raise PydanticCustomError(
                    "init_from",
                    "{message}",
                    {
                        "message": (
                            f"model.{name} = {given!r} disagrees with {fields[name]!r} in {where} "
                            f"(model.init_from); fix: remove model.{name} or make it agree"
                        )
                    },
                )
        # rope_theta and rope_scaling in the spec win: that is how a context is extended.
        return {**fields, **data}

    @model_validator(mode="after")
    def _check_shape(self) -> ModelSpec:
        problems = []
        if self.hidden % self.heads:
            problems.append(
                _problem(
                    ("hidden",),
                    self.hidden,
                    f"hidden = {self.hidden} must be divisible by heads = {self.heads} "
                    "(head_dim = hidden / heads); fix: change hidden or heads",
                )
            )
        if self.heads % self.kv_heads:
            problems.append(
                _problem(
                    ("kv_heads",),
                    self.kv_heads,
                    f"heads = {self.heads} must be divisible by kv_heads = {self.kv_heads} "
                    "(each K/V head serves a whole group of query heads); fix: pick kv_heads that "
                    "divides heads",
                )
            )
        elif self.hidden % self.heads == 0 and (self.hidden // self.heads) % 2:
            problems.append(
                _problem(
                    ("hidden",),
                    self.hidden,
                    f"head_dim = hidden / heads = {self.hidden // self.heads} must be even for "
                    "RoPE (it rotates pairs); fix: change hidden or heads",
                )
            )
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------
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
        """Each data file this machine lacks, as "training.data.<field>: <why>". Not a
        validation error: a spec is rendered and submitted where the data may not be (a login
        node, a laptop); the trainer refuses to start without it, and validation warns."""
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
                missing = [str(f) for f in indexed_files(value) if not f.is_file()]
                if missing:
                    out.append(
                        f"training.data.{name} {value}: no such file: "
                        f"{', '.join(missing)} (make it with `ctxlaunch data prepare`)"
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


class EvalSpec(_Strict):
    """Evaluation at length on held-out data (`ctxlaunch eval`, and every `interval` steps
    during training): loss and perplexity per context-length bucket, and the passkey probe.
    Runs forward only, at the job's own layout (pp 1)."""

    interval: int = Field(0, ge=0)
    """Evaluate every this many training steps; 0: only through `ctxlaunch eval`."""
    sequences: PositiveInt = 8
    """Held-out sequences of seq_len tokens to score (fewer if the held-out data is shorter)."""
    buckets: PositiveInt = 6
    """Context-length buckets, doubling up to seq_len: with 6 at 8,192 tokens the buckets are
    [0, 256), [256, 512), ... [4096, 8192). A token's context length is its position (the
    RoPE position: in its document when positions restart per document)."""
    tokenizer: str | None = None
    """The tokenizer of the data (tokenizer.json, a SentencePiece model or a tiktoken file),
    for the passkey prompts on source: tokens; byte-level text needs none."""
    passkey: PasskeySpec = PasskeySpec()


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
    """Optimizer steps to run."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """none: keep all activations; selective: recompute each block's feed-forward half (cheap,
    linear in s) and keep attention (quadratic to recompute); full: keep only each block's input
    and recompute the block in backward."""
    zero_stage: int = Field(0, ge=0, le=3)
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters, each sharded
    over the DP x CP ranks (by `engine`)."""
    engine: Literal["auto", "fsdp2", "deepspeed"] = "auto"
    """What shards the model states for zero_stage >= 1. fsdp2: torch FSDP2 over DP x CP, at
    any layout, checkpoints that resume at any TP, PP, CP and DP degree. deepspeed: DeepSpeed
    ZeRO, at TP 1 x PP 1 only, checkpoints in DeepSpeed's own format (they resume only at the
    same layout). auto: deepspeed at TP 1 x PP 1, fsdp2 otherwise. ZeRO-0 is plain torch
    whatever this says (`JobSpec.state_engine` resolves it)."""
    optimizer: OptimizerSpec = OptimizerSpec()
    seed: int = Field(0, ge=0)
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


# --------------------------------------------------------------------------------------------
# parallelism
# --------------------------------------------------------------------------------------------
class ParallelSpec(_Strict):
    """The parallel layout. TP x PP x CP x EP x DP = nodes x gpus_per_node. Rank order (innermost
    first): TP, CP, EP, DP, PP, so a CP group is consecutive ranks, inside a node where it fits."""

    tp: PositiveInt = 1
    """Tensor parallel degree."""
    pp: PositiveInt = 1
    """Pipeline parallel degree."""
    virtual_stages: PositiveInt = 1
    """Pipeline stages per PP rank: above 1 the trainer runs interleaved 1F1B over pp x
    virtual_stages stages (rank r holds stages r, r + pp, ...), shrinking the bubble."""
    stage_layers: list[PositiveInt] | None = None
    """Optional: blocks per pipeline stage, first to last (pp x virtual_stages entries summing
    to model.layers). Default: balanced, counting the embedding and the loss head as one layer
    each on the end stages (see ctxlaunch.contract.stages)."""
    cp: PositiveInt = 1
    """Context parallel degree: the sequence is split across this many ranks."""
    ep: PositiveInt = 1
    """Expert parallel degree (needs a mixture-of-experts model; ctxlaunch models are dense)."""
    dp: PositiveInt | None = None
    """Data parallel degree; derived from the GPU count when not given."""
    cp_algorithm: Literal["ring", "ulysses", "hybrid"] = "ring"
    """ring: K/V blocks travel around the CP ranks; ulysses: all-to-all to head-sharded
    attention (degree <= kv_heads); hybrid: Ulysses inside each group of ulysses_degree ranks x
    ring across the groups."""
    ulysses_degree: PositiveInt | None = None
    """Hybrid only: the Ulysses (inner) degree; ring degree = cp / ulysses_degree."""
    ring_degree: PositiveInt | None = None
    """Hybrid only, optional: the ring (outer) degree; must equal cp / ulysses_degree."""
    cp_sharding: Literal["zigzag", "contiguous"] = "zigzag"
    """How the sequence is split across CP ranks (what torch's context parallel calls the load
    balancer): zigzag (rank i holds chunks i and 2N-1-i of 2N, balancing causal work; needs
    seq_len % 2N == 0) or contiguous (seq_len % N == 0). Formerly `layout`, still accepted
    with a deprecation warning."""

    _renamed: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _accept_renamed_fields(cls, data: Any, handler: Any) -> ParallelSpec:
        """Take a field under its old name (RENAMED_PARALLEL_FIELDS), warning once."""
        renamed: list[str] = []
        if isinstance(data, dict):
            data = dict(data)
            for old, new in RENAMED_PARALLEL_FIELDS.items():
                if old not in data:
                    continue
                value = data.pop(old)
                if new in data and data[new] != value:
                    raise ValueError(
                        f"parallel.{old} (the old name of parallel.{new}) is "
                        f"{value!r} but parallel.{new} is {data[new]!r}; fix: "
                        f"give only parallel.{new}"
                    )
                data[new] = value
                renamed.append(
                    f"parallel.{old} is deprecated: write parallel.{new} (the same values)"
                )
                warnings.warn(renamed[-1], DeprecationWarning, stacklevel=2)
        spec = handler(data)
        spec._renamed = renamed
        return spec

    @property
    def deprecations(self) -> list[str]:
        """One sentence per field given under its old name."""
        return list(self._renamed)


RENAMED_PARALLEL_FIELDS = {"layout": "cp_sharding"}
"""Old name -> new name of `parallel` fields that are still read under the old one."""


# --------------------------------------------------------------------------------------------
# cluster
# --------------------------------------------------------------------------------------------
class SlurmSpec(_Strict):
    """sbatch settings."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = "04:00:00"
    """Slurm time format: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    exclusive: bool = True
    """Whole nodes: long-context jobs want every GPU, NIC and CPU of a node."""
    requeue: bool = True
    """Requeue on preemption or node failure (the trainer resumes from its checkpoint)."""
    max_restarts: int = Field(3, ge=0)
    """Give up after this many requeues."""
    signal_seconds: int = Field(120, ge=0)
    """Ask Slurm for SIGUSR1 this many seconds before the time limit, to checkpoint; 0 = none."""
    cpus_per_task: PositiveInt | None = None
    """CPU cores per rank; default: Slurm's."""
    mem: str | None = None
    """Host memory per node (sbatch --mem), e.g. 0 for all of it or 512G."""
    log_dir: str = "."
    """Where sbatch writes the job's output (`<name>-<jobid>.out`), relative to the submit
    directory; it must exist when the job starts (sbatch does not create it)."""

    @field_validator("partition", "account", "qos")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_NAME.match(value):
            raise ValueError(
                f"{value!r} is not a Slurm name: use letters, digits, '_', '.', '-' only"
            )
        return value

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.match(value):
            raise ValueError(
                f"{value!r} is not a Slurm time: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                "D-HH:MM:SS"
            )
        return value

    @field_validator("mem")
    @classmethod
    def _slurm_mem(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^\d+[KMGT]?$", value):
            raise ValueError(f"{value!r} is not a Slurm memory size: e.g. 0, 512G, 480000M")
        return value

    @field_validator("log_dir")
    @classmethod
    def _log_dir(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9_./\-]+$", value):
            raise ValueError(f"{value!r}: use letters, digits, '_', '.', '-', '/' only")
        return value


class Toleration(_Strict):
    """A Kubernetes toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class KubernetesSpec(_Strict):
    """Kubernetes settings: a PyTorchJob (Kubeflow training-operator, kubeflow.org/v1) or a
    TrainJob (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1)."""

    api: Literal["pytorchjob", "trainjob"] = "pytorchjob"
    """pytorchjob: a PyTorchJob (training-operator 1.9, Kubernetes 1.28+); trainjob: a TrainJob
    and its own TrainingRuntime (Kubeflow Trainer 2.3, JobSet, Kubernetes 1.31+)."""
    queue: str | None = None
    """Kueue LocalQueue: sets the kueue.x-k8s.io/queue-name label and submits the job
    suspended, for Kueue to admit (PyTorchJob runPolicy.suspend, TrainJob spec.suspend)."""
    scheduler: Literal["volcano", "coscheduling"] | None = None
    """Gang scheduling, so that all nodes start together or none does: volcano (Volcano's
    scheduler and PodGroup) or coscheduling (scheduler-plugins' PodGroup); default none."""
    scheduler_queue: str | None = None
    """Volcano queue of the job's PodGroup (scheduler: volcano only)."""
    schedule_timeout_seconds: PositiveInt | None = None
    """How long the gang may wait for all its pods to be schedulable (coscheduling only;
    Trainer's default 60 s)."""
    namespace: str = "default"
    image: str | None = None
    """Container image with ctxlaunch installed (required for target: kubernetes)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    service_account: str | None = None
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    image_pull_secrets: list[str] = []
    """Names of Secrets for pulling the image."""
    host_network: bool = False
    """Run pods on the host network (RDMA without a CNI); sets dnsPolicy ClusterFirstWithHostNet."""
    shm_size: str = "64Gi"
    """Size limit of the memory-backed /dev/shm (the default 64 MiB breaks NCCL and dataloaders)."""
    rdma_resource: str | None = None
    """RDMA device-plugin resource name, e.g. rdma/ib; default: rdma/ib on InfiniBand/RoCE."""
    rdma_per_node: PositiveInt | None = None
    """RDMA resource count per pod; default: one per GPU."""
    cpu: str | None = None
    """CPU request/limit per pod (Kubernetes quantity)."""
    memory: str | None = None
    """Memory request/limit per pod (Kubernetes quantity)."""
    backoff_limit: int = Field(3, ge=0)
    active_deadline_seconds: PositiveInt | None = None
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    clean_pod_policy: Literal["None", "Running", "All"] = "None"
    priority_class: str | None = None

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if len(value) > 63 or not RFC1123_LABEL.match(value):
            raise ValueError(
                f"{value!r} is not a valid namespace: an RFC 1123 label (lowercase letters, "
                "digits and '-', starting and ending with a letter or digit, at most 63)"
            )
        return value

    @field_validator("queue", "scheduler_queue")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 63 or not RFC1123_LABEL.match(value)):
            raise ValueError(
                f"{value!r} is not a valid queue name: an RFC 1123 label (lowercase letters, "
                "digits and '-', at most 63)"
            )
        return value

    @model_validator(mode="after")
    def _scheduler_options(self) -> KubernetesSpec:
        if self.scheduler_queue is not None and self.scheduler != "volcano":
            raise ValueError("scheduler_queue is a Volcano queue: it needs scheduler: volcano")
        if self.schedule_timeout_seconds is not None and self.scheduler != "coscheduling":
            raise ValueError("schedule_timeout_seconds needs scheduler: coscheduling")
        return self

    @field_validator("service_account", "priority_class")
    @classmethod
    def _subdomain(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 253 or not RFC1123_SUBDOMAIN.match(value)):
            raise ValueError(
                f"{value!r} is not a valid name: an RFC 1123 subdomain (lowercase letters, "
                "digits, '-' and '.')"
            )
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _secrets(cls, value: list[str]) -> list[str]:
        for name in value:
            if len(name) > 253 or not RFC1123_SUBDOMAIN.match(name):
                raise ValueError(f"{name!r} is not a valid Secret name (RFC 1123 subdomain)")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        if value is not None and not IMAGE_REF.match(value):
            raise ValueError(f"{value!r} is not an image reference")
        return value

    @field_validator("shm_size", "cpu", "memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not K8S_QUANTITY.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 64Gi, 96, 1500Mi)")
        return value

    @field_validator("rdma_resource")
    @classmethod
    def _resource(cls, value: str | None) -> str | None:
        if value is not None and not LABEL_KEY.match(value):
            raise ValueError(f"{value!r} is not a resource name (e.g. rdma/ib)")
        return value

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not LABEL_KEY.match(key) or not LABEL_VALUE.match(label) or len(label) > 63:
                raise ValueError(f"{key!r}: {label!r} is not a valid label selector pair")
        return value


class ClusterSpec(_Strict):
    """Where the job runs and on what."""

    target: Literal["local", "slurm", "kubernetes"] = "local"
    """local: this machine (torchrun); slurm: sbatch via submitit; kubernetes: a PyTorchJob or
    a TrainJob (cluster.kubernetes.api)."""
    nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = 1
    """GPUs per node, one rank each (for gpu: cpu, the number of CPU processes)."""
    gpu: GpuType = "H100"
    """GPU type; its memory and peak FLOP/s come from ctxlaunch.contract.hardware.GPUS."""
    slurm: SlurmSpec = SlurmSpec()
    kubernetes: KubernetesSpec = KubernetesSpec()
    profile: str | None = None
    """A machine profile (JSON) that `ctxlaunch calibrate SPEC --submit` measured on this
    cluster; plan, advise, telemetry's predicted step and report time the job with it. A
    relative path is taken from the working directory and stored absolute."""

    @field_validator("profile")
    @classmethod
    def _profile_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise ValueError(
                f"{value}: no such file (a machine profile written by "
                "`ctxlaunch calibrate SPEC --submit`)"
            )
        return str(path)

    @model_validator(mode="after")
    def _check_profile(self) -> ClusterSpec:
        if self.profile is None:
            return self
        import json

        try:
            data = json.loads(Path(self.profile).read_text())
        except (OSError, ValueError) as exc:
            raise ValidationError.from_exception_data(
                "ClusterSpec",
                [
                    _problem(
                        ("profile",),
                        self.profile,
                        f"{self.profile}: not a readable JSON machine profile ({exc})",
                    )
                ],
            ) from None
        gpu = data.get("gpu") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValidationError.from_exception_data(
                "ClusterSpec",
                [
                    _problem(
                        ("profile",),
                        self.profile,
                        f"{self.profile}: not a machine profile (no "
                        f"format {PROFILE_FORMAT!r}); write one with `ctxlaunch calibrate SPEC "
                        "--submit`",
                    )
                ],
            )
        if gpu != self.gpu:
            raise ValidationError.from_exception_data(
                "ClusterSpec",
                [
                    _problem(
                        ("profile",),
                        self.profile,
                        f"{self.profile} was measured on gpu {gpu!r}, but "
                        f"cluster.gpu is {self.gpu!r}; fix: calibrate this cluster or name its "
                        "profile",
                    )
                ],
            )
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def profile_fabric(self) -> str | None:
        """The fabric the named profile was measured over (None: no profile)."""
        if self.profile is None:
            return None
        import json

        return str(json.loads(Path(self.profile).read_text()).get("fabric"))

    @property
    def gpu_info(self) -> GpuInfo:
        return gpu_info(self.gpu)


# --------------------------------------------------------------------------------------------
# fabric
# --------------------------------------------------------------------------------------------
class FabricSpec(_Strict):
    """The interconnect, and the NCCL environment it needs."""

    nvlink_domain: PositiveInt | None = None
    """GPUs per NVLink/NVSwitch domain; default from the GPU type (8, or 1 for PCIe-only)."""
    network: NetworkType = "infiniband-ndr"
    """Inter-node network; picks the NCCL defaults (see ctxlaunch.contract.hardware.FABRIC_NCCL_ENV)."""
    hcas: list[str] = []
    """HCA names for NCCL_IB_HCA, matched exactly (rendered with a leading '=')."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for bootstrap (e.g. eth0, or ^lo,docker)."""
    gid_index: int | None = Field(None, ge=0)
    """NCCL_IB_GID_INDEX; default 3 on RoCE (RoCE v2)."""
    gdr_level: str | None = None
    """NCCL_NET_GDR_LEVEL (LOC, PIX, PXB, PHB, SYS)."""
    topo_file: str | None = None
    """NCCL_TOPO_FILE: a topology XML (cloud VMs)."""
    nccl: dict[str, str] = {}
    """Per-job NCCL/torch variables, overriding the fabric defaults key by key."""
    env: dict[str, str] = {}
    """Any other environment for the trainer (overrides everything else)."""

    @field_validator("hcas")
    @classmethod
    def _hcas(cls, value: list[str]) -> list[str]:
        for hca in value:
            if not re.match(r"^[A-Za-z0-9_]+(:\d+)?$", hca):
                raise ValueError(f"{hca!r} is not an HCA name (e.g. mlx5_0 or mlx5_0:1)")
        return value

    @field_validator("gdr_level")
    @classmethod
    def _gdr(cls, value: str | None) -> str | None:
        if (
            value is not None
            and value not in {"LOC", "PIX", "PXB", "PHB", "SYS"}
            and not value.isdigit()
        ):
            raise ValueError(f"{value!r}: use LOC, PIX, PXB, PHB, SYS or a number")
        return value

    @field_validator("nccl", "env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, setting in value.items():
            if not ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if "\x00" in setting:
                raise ValueError(f"{name}: the value contains a NUL byte")
        return value


# --------------------------------------------------------------------------------------------
# telemetry
# --------------------------------------------------------------------------------------------
class TelemetrySpec(_Strict):
    """Prometheus export from every rank."""

    prometheus: Literal["off", "scrape", "push"] = "off"
    """scrape: each rank serves /metrics on port + local rank; push: ranks push to a
    Pushgateway (batch jobs, Slurm)."""
    port: int = Field(9400, ge=1024, le=65535)
    """First scrape port (rank r on a node uses port + local rank)."""
    pushgateway_url: str | None = None
    """e.g. http://pushgateway.monitoring:9091 (push mode)."""
    push_interval_seconds: float = Field(15.0, gt=0)

    @field_validator("pushgateway_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(
            r"^https?://[A-Za-z0-9._\-\[\]:]+(/[\w./\-]*)?$", value
        ):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @model_validator(mode="after")
    def _push_needs_url(self) -> TelemetrySpec:
        if self.prometheus == "push" and not self.pushgateway_url:
            raise ValidationError.from_exception_data(
                "TelemetrySpec",
                [
                    _problem(
                        ("pushgateway_url",),
                        None,
                        "telemetry.prometheus = push needs telemetry.pushgateway_url",
                    )
                ],
            )
        return self


# --------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------
class JobSpec(_Strict):
    """A long-context training job: model, training, parallel layout, cluster, fabric,
    telemetry."""

    name: str
    """Job name: an RFC 1123 label of at most 48 characters (it names pods and Slurm jobs)."""
    model: ModelSpec
    training: TrainingSpec
    parallel: ParallelSpec = ParallelSpec()
    cluster: ClusterSpec = ClusterSpec()
    fabric: FabricSpec = FabricSpec()
    telemetry: TelemetrySpec = TelemetrySpec()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > MAX_JOB_NAME or not RFC1123_LABEL.match(value):
            raise ValueError(
                f"{value!r} is not a valid job name: lowercase letters, digits and '-', "
                f"starting and ending with a letter or digit, at most {MAX_JOB_NAME} "
                "characters (it names Slurm jobs and Kubernetes pods)"
            )
        return value

    @model_validator(mode="after")
    def _check_layout(self) -> JobSpec:
        problems = layout_problems(self)
        fabric = self.cluster.profile_fabric
        if fabric is not None and fabric != self.fabric.network:
            problems.append(
                _problem(
                    ("cluster", "profile"),
                    self.cluster.profile,
                    f"{self.cluster.profile} was measured over fabric {fabric!r}, but "
                    f"fabric.network is {self.fabric.network!r}; fix: calibrate this cluster or "
                    "name its profile",
                )
            )
        if problems:
            raise ValidationError.from_exception_data("JobSpec", problems)
        return self

    # Derived quantities used everywhere; computed, never stored.
    @property
    def dp(self) -> int:
        p = self.parallel
        return p.dp if p.dp is not None else self.cluster.world_size // (p.tp * p.pp * p.cp * p.ep)

    @property
    def ulysses_degree(self) -> int:
        """Ulysses (inner) degree of the CP group: cp for ulysses, 1 for ring."""
        p = self.parallel
        if p.cp_algorithm == "ulysses":
            return p.cp
        if p.cp_algorithm == "hybrid":
            return p.ulysses_degree or 1
        return 1

    @property
    def ring_degree(self) -> int:
        """Ring (outer) degree of the CP group."""
        return self.parallel.cp // self.ulysses_degree

    @property
    def grad_accum(self) -> int:
        t = self.training
        if t.grad_accum is not None:
            return t.grad_accum
        if t.global_batch is not None:
            return t.global_batch // (t.micro_batch * self.dp)
        return 1

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.training.micro_batch * self.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.training.seq_len

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Blocks per pipeline stage (pp x virtual_stages entries), given or balanced."""
        p = self.parallel
        if p.stage_layers is not None:
            return tuple(p.stage_layers)
        return balanced_stage_layers(self.model.layers, p.pp * p.virtual_stages)

    @property
    def state_engine(self) -> StateEngine:
        """What keeps the model states: the one rule the trainer and the planner both read."""
        t, p = self.training, self.parallel
        return resolve_state_engine(t.engine, t.zero_stage, tp=p.tp, pp=p.pp)

    @property
    def nvlink_domain(self) -> int:
        return self.fabric.nvlink_domain or self.cluster.gpu_info.nvlink_domain

    def warnings(self) -> list[str]:
        """Legal but poor choices, worth a second look (not errors)."""
        return layout_warnings(self)


StateEngine = Literal["torch", "fsdp2", "deepspeed"]
"""torch: every rank keeps whole fp32 states of its slice (ZeRO-0); fsdp2: FSDP2 shards them
over DP x CP; deepspeed: DeepSpeed ZeRO does (bf16 weights, fp32 master copy)."""


def resolve_state_engine(engine: str, zero_stage: int, *, tp: int, pp: int) -> StateEngine:
    """The engine `training.engine` means at this ZeRO stage and layout (see TrainingSpec)."""
    if zero_stage == 0:
        return "torch"
    if engine == "deepspeed" or (engine == "auto" and tp == 1 and pp == 1):
        return "deepspeed"
    return "fsdp2"


def _field_docstrings() -> dict[str, dict[str, str]]:
    """class name -> field -> the docstring right under the field, as pydantic's
    use_attribute_docstrings reads them (a string statement after an annotated name)."""
    import ast
    import inspect
    import itertools

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    found: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = found.setdefault(node.name, {})
        for field, after in itertools.pairwise(node.body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = inspect.cleandoc(after.value.value)
    return found


def _describe_fields() -> None:
    """Give every field without a description its docstring (from the class up the MRO that
    declares it), and rebuild the models, the nested ones first, so that
    model_json_schema says them."""
    docs = _field_docstrings()
    models = [
        m
        for m in globals().values()
        if isinstance(m, type) and issubclass(m, _Strict) and m.__module__ == __name__
    ]
    changed = False
    for model in models:
        for name, info in model.model_fields.items():
            owner = next(
                (k for k in model.__mro__ if name in k.__dict__.get("__annotations__", {})), model
            )
            doc = docs.get(owner.__name__, {}).get(name)
            if info.description is None and doc is not None:
                info.description = doc
                changed = True
    if changed:
        for model in models:  # definition order: a model after the ones it holds
            model.model_rebuild(force=True)


def json_schema() -> dict[str, Any]:
    """The spec's JSON Schema, for editors. A model is a preset name, a preset with
    overrides, a Hugging Face checkpoint (init_from) or a full shape, so the shape fields are
    required only without a preset or init_from."""
    _describe_fields()
    schema = JobSpec.model_json_schema()
    model = schema["$defs"]["ModelSpec"]
    shape = model.pop("required", [])
    presets = sorted(MODEL_PRESETS)
    model["properties"]["preset"] = {
        "anyOf": [{"enum": presets}, {"type": "null"}],
        "default": None,
        "description": model["properties"]["preset"].get("description", ""),
    }
    model["anyOf"] = [{"required": ["preset"]}, {"required": ["init_from"]}, {"required": shape}]
    schema["properties"]["model"] = {"anyOf": [{"enum": presets}, {"$ref": "#/$defs/ModelSpec"}]}
    return schema


def layout_problems(spec: JobSpec) -> list[InitErrorDetails]:
    """Every rule that ties the layout to the model and the cluster; all broken ones at once."""
    m, t, p, c = spec.model, spec.training, spec.parallel, spec.cluster
    out: list[InitErrorDetails] = []
    world = c.world_size
    non_dp = p.tp * p.pp * p.cp * p.ep
    composition_ok = (world % non_dp == 0) if p.dp is None else (non_dp * p.dp == world)

    # Composition: TP x PP x CP x EP x DP = nodes x gpus_per_node.
    if p.dp is None:
        if world % non_dp:
            out.append(
                _problem(
                    ("parallel",),
                    {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep},
                    f"tp x pp x cp x ep = {non_dp} must divide the GPU count nodes x gpus_per_node "
                    f"= {c.nodes} x {c.gpus_per_node} = {world} (dp is derived as the quotient); "
                    "fix: change a degree or the node count",
                )
            )
    elif non_dp * p.dp != world:
        out.append(
            _problem(
                ("parallel", "dp"),
                p.dp,
                f"tp x pp x cp x ep x dp = {p.tp} x {p.pp} x {p.cp} x {p.ep} x {p.dp} = "
                f"{non_dp * p.dp}, but nodes x gpus_per_node = {world}; fix: make them equal, or "
                "omit dp to derive it",
            )
        )

    if m.heads % p.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                p.tp,
                f"model.heads = {m.heads} must be divisible by tp = {p.tp}",
            )
        )
    if m.kv_heads % p.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                p.tp,
                f"model.kv_heads = {m.kv_heads} must be divisible by tp = {p.tp} (each TP rank "
                "needs whole K/V heads)",
            )
        )
    if t.engine == "deepspeed" and (p.tp > 1 or p.pp > 1):
        out.append(
            _problem(
                ("training", "engine"),
                t.engine,
                f"engine deepspeed shards whole-model states and knows nothing of TP slices or "
                f"pipeline stages, but tp = {p.tp}, pp = {p.pp}; fix: engine: fsdp2 (or auto), or "
                "tp: 1 and pp: 1",
            )
        )
    if t.engine == "deepspeed" and t.zero_stage == 0:
        out.append(
            _problem(
                ("training", "engine"),
                t.engine,
                "engine deepspeed needs zero_stage >= 1 (ZeRO-0 is plain torch); fix: "
                "zero_stage: 1, 2 or 3, or engine: auto",
            )
        )
    out.extend(pipeline_problems(m, p, spec.grad_accum if composition_ok else None))
    out.extend(tensor_parallel_problems(m, p, t.seq_len))
    if p.ep > 1:
        out.append(
            _problem(
                ("parallel", "ep"),
                p.ep,
                "ep > 1 needs a mixture-of-experts model; ctxlaunch models are dense; fix: ep: 1",
            )
        )

    out.extend(cp_problems(m, p, t.seq_len))

    # Batch arithmetic.
    dp = spec.dp if composition_ok else None
    if dp and t.global_batch is not None:
        per_step = t.micro_batch * dp
        if t.global_batch % per_step:
            out.append(
                _problem(
                    ("training", "global_batch"),
                    t.global_batch,
                    f"global_batch must be a multiple of micro_batch x dp = {t.micro_batch} x {dp} "
                    f"= {per_step}; fix: global_batch = {_round_up(t.global_batch, per_step)}",
                )
            )
        elif t.grad_accum is not None and t.grad_accum * per_step != t.global_batch:
            out.append(
                _problem(
                    ("training", "grad_accum"),
                    t.grad_accum,
                    f"grad_accum = {t.grad_accum} disagrees with global_batch / (micro_batch x dp) "
                    f"= {t.global_batch // per_step}; fix: give only one of them",
                )
            )

    if t.data.source == "text" and m.vocab < 256:
        out.append(_problem(("model", "vocab"), m.vocab, "byte-level text data needs vocab >= 256"))
    out.extend(eval_problems(t, p))

    # Targets.
    if c.target == "local" and c.nodes != 1:
        out.append(
            _problem(
                ("cluster", "nodes"), c.nodes, "target local runs on this machine: nodes must be 1"
            )
        )
    if c.target == "kubernetes" and not c.kubernetes.image:
        out.append(
            _problem(
                ("cluster", "kubernetes", "image"),
                None,
                "target kubernetes needs an image with ctxlaunch installed",
            )
        )
    return out


def eval_problems(t: TrainingSpec, p: ParallelSpec) -> list[InitErrorDetails]:
    """Evaluation runs forward only, on the job's layout, without a pipeline schedule."""
    out: list[InitErrorDetails] = []
    e = t.eval
    if e.interval and p.pp > 1:
        out.append(
            _problem(
                ("training", "eval", "interval"),
                e.interval,
                f"evaluation during training needs pp = 1 (it runs forward only, with no pipeline "
                f"schedule), but pp = {p.pp}; fix: interval: 0, and run `ctxlaunch eval` on the "
                "checkpoint with --set parallel.pp=1 (checkpoints load at any layout)",
            )
        )
    for i, length in enumerate(e.passkey.lengths or []):
        if length > t.seq_len:
            out.append(
                _problem(
                    ("training", "eval", "passkey", "lengths", i),
                    length,
                    f"a passkey prompt of {length} tokens does not fit in training.seq_len = "
                    f"{t.seq_len}; fix: at most {t.seq_len}",
                )
            )
    return out


def pipeline_problems(
    m: ModelSpec, p: ParallelSpec, grad_accum: int | None
) -> list[InitErrorDetails]:
    """Stages: at least one block each, an explicit split that adds up, and enough
    micro-batches to fill the schedule."""
    out: list[InitErrorDetails] = []
    stages = p.pp * p.virtual_stages
    if p.virtual_stages > 1 and p.pp == 1:
        out.append(
            _problem(
                ("parallel", "virtual_stages"),
                p.virtual_stages,
                "virtual_stages > 1 interleaves pipeline stages and needs pp > 1; fix: "
                "virtual_stages: 1",
            )
        )
    if p.stage_layers is not None:
        if len(p.stage_layers) != stages:
            out.append(
                _problem(
                    ("parallel", "stage_layers"),
                    p.stage_layers,
                    f"stage_layers has {len(p.stage_layers)} entries but there are pp x "
                    f"virtual_stages = {p.pp} x {p.virtual_stages} = {stages} stages; fix: one "
                    "entry per stage, or omit it for a balanced split",
                )
            )
        elif sum(p.stage_layers) != m.layers:
            out.append(
                _problem(
                    ("parallel", "stage_layers"),
                    p.stage_layers,
                    f"stage_layers sum to {sum(p.stage_layers)} but model.layers = {m.layers}; "
                    "fix: make them add up, or omit stage_layers for a balanced split",
                )
            )
    elif m.layers < stages:
        out.append(
            _problem(
                ("parallel", "pp"),
                p.pp,
                f"model.layers = {m.layers} cannot fill pp x virtual_stages = {stages} stages "
                "with at least one block each; fix: fewer stages",
            )
        )
    if p.pp > 1 and m.tie_embeddings:
        out.append(
            _problem(
                ("model", "tie_embeddings"),
                True,
                "tied embeddings put one weight on the first and the last pipeline stage; the "
                "trainer does not synchronise it across stages; fix: tie_embeddings: false or pp: 1",
            )
        )
    if p.pp > 1 and grad_accum is not None and 0 < grad_accum < p.pp:
        out.append(
            _problem(
                ("training", "grad_accum"),
                grad_accum,
                f"the pipeline runs the step's {grad_accum} micro-batches (grad_accum) through "
                f"pp = {p.pp} stages; 1F1B needs at least one per stage; fix: grad_accum (or "
                f"global_batch / (micro_batch x dp)) >= {p.pp}",
            )
        )
    elif p.virtual_stages > 1 and grad_accum is not None and grad_accum % p.pp:
        out.append(
            _problem(
                ("training", "grad_accum"),
                grad_accum,
                f"interleaved 1F1B runs the step's {grad_accum} micro-batches (grad_accum) in "
                f"rounds of pp = {p.pp}; fix: grad_accum (or global_batch) a multiple of {p.pp}",
            )
        )
    return out


def tensor_parallel_problems(m: ModelSpec, p: ParallelSpec, seq_len: int) -> list[InitErrorDetails]:
    """TP splits heads, the SwiGLU width and the vocabulary; sequence parallelism splits each
    CP rank's tokens."""
    out: list[InitErrorDetails] = []
    if p.tp == 1:
        return out
    if m.ffn_hidden % p.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                p.tp,
                f"model.ffn_hidden = {m.ffn_hidden} must be divisible by tp = {p.tp} (the SwiGLU "
                "width is split over the TP ranks)",
            )
        )
    if m.vocab % p.tp:
        out.append(
            _problem(
                ("parallel", "tp"),
                p.tp,
                f"model.vocab = {m.vocab} must be divisible by tp = {p.tp} (the embedding and the "
                "output head are split by vocabulary)",
            )
        )
    if seq_len % (p.cp * p.tp):
        out.append(
            _problem(
                ("training", "seq_len"),
                seq_len,
                f"sequence parallelism splits each CP rank's seq_len / cp tokens over tp = {p.tp} "
                f"ranks: seq_len must be divisible by cp x tp = {p.cp * p.tp}; fix: seq_len = "
                f"{_round_up(seq_len, p.cp * p.tp)}",
            )
        )
    return out


def cp_problems(m: ModelSpec, p: ParallelSpec, seq_len: int) -> list[InitErrorDetails]:
    """The rules a CP degree, algorithm and sharding must meet for this model and sequence."""
    out: list[InitErrorDetails] = []
    # Sequence divisibility, caught here instead of at run time. Hybrid and Ulysses shard the
    # same way as the ring: a CP sharding means the same token placement whatever the algorithm.
    if p.cp > 1:
        if p.cp_sharding == "zigzag" and seq_len % (2 * p.cp):
            out.append(
                _problem(
                    ("training", "seq_len"),
                    seq_len,
                    f"cp_sharding zigzag with cp = {p.cp} needs seq_len divisible by 2 x cp = "
                    f"{2 * p.cp} (each rank holds chunks i and 2N-1-i of 2N); fix: seq_len = "
                    f"{_round_up(seq_len, 2 * p.cp)}",
                )
            )
        if p.cp_sharding == "contiguous" and seq_len % p.cp:
            out.append(
                _problem(
                    ("training", "seq_len"),
                    seq_len,
                    f"cp_sharding contiguous with cp = {p.cp} needs seq_len divisible by cp; fix: "
                    f"seq_len = {_round_up(seq_len, p.cp)}",
                )
            )
    heads_per_tp, kv_per_tp = m.heads // p.tp or 1, m.kv_heads // p.tp or 1
    if p.cp_algorithm != "hybrid" and (p.ulysses_degree is not None or p.ring_degree is not None):
        field = "ulysses_degree" if p.ulysses_degree is not None else "ring_degree"
        out.append(
            _problem(
                ("parallel", field),
                getattr(p, field),
                f"{field} applies to cp_algorithm hybrid only (this spec uses {p.cp_algorithm}); "
                "fix: remove it, or use cp_algorithm: hybrid",
            )
        )
    if p.cp_algorithm == "ulysses":
        out.extend(
            _ulysses_problems(("parallel", "cp"), p.cp, heads_per_tp, kv_per_tp, p.cp, hybrid=False)
        )
    elif p.cp_algorithm == "hybrid":
        if p.ulysses_degree is None:
            out.append(
                _problem(
                    ("parallel", "ulysses_degree"),
                    None,
                    "cp_algorithm hybrid needs ulysses_degree (the inner, all-to-all degree); "
                    f"the ring degree is cp / ulysses_degree; e.g. ulysses_degree: "
                    f"{_largest_common_divisor_at_most((p.cp, heads_per_tp, kv_per_tp), p.cp)}",
                )
            )
        else:
            u = p.ulysses_degree
            if p.cp % u:
                out.append(
                    _problem(
                        ("parallel", "ulysses_degree"),
                        u,
                        f"hybrid degrees multiply to cp: ulysses_degree = {u} must divide cp = "
                        f"{p.cp}",
                    )
                )
            elif p.ring_degree is not None and p.ring_degree * u != p.cp:
                out.append(
                    _problem(
                        ("parallel", "ring_degree"),
                        p.ring_degree,
                        f"hybrid degrees multiply to cp: ulysses_degree x ring_degree = {u} x "
                        f"{p.ring_degree} = {u * p.ring_degree}, but cp = {p.cp}",
                    )
                )
            out.extend(
                _ulysses_problems(
                    ("parallel", "ulysses_degree"), u, heads_per_tp, kv_per_tp, p.cp, hybrid=True
                )
            )
    return out


def _ulysses_problems(
    loc: tuple[str, ...], degree: int, heads: int, kv_heads: int, cp: int, *, hybrid: bool
) -> list[InitErrorDetails]:
    out = []
    best = _largest_common_divisor_at_most((cp, heads, kv_heads), kv_heads)
    if hybrid:
        fix = f"ulysses_degree: {best} (ring degree {cp // best})"
    elif best > 1:
        fix = (
            f"use cp_algorithm: hybrid with ulysses_degree: {best} (ring degree "
            f"{cp // best}), so Ulysses stays within the K/V heads and a ring covers the rest"
        )
    else:
        fix = "use cp_algorithm: ring"
    if heads % degree:
        out.append(
            _problem(
                loc,
                degree,
                f"the Ulysses degree {degree} must divide the query heads per TP rank ({heads}): "
                f"the all-to-all hands each rank whole heads; fix: {fix}",
            )
        )
    if degree > kv_heads or kv_heads % degree:
        out.append(
            _problem(
                loc,
                degree,
                f"the Ulysses degree {degree} "
                + (
                    f"exceeds the K/V heads per TP rank ({kv_heads})"
                    if degree > kv_heads
                    else f"does not divide the K/V heads per TP rank ({kv_heads})"
                )
                + f": each rank must receive whole K/V heads; fix: {fix}",
            )
        )
    return out


def layout_warnings(spec: JobSpec) -> list[str]:
    p, c = spec.parallel, spec.cluster
    gpu = c.gpu_info
    out = []
    cp_span = p.tp * p.cp  # consecutive ranks one CP group (with its TP ranks) covers
    if p.cp > 1 and c.gpu != "cpu" and not gpu.nvlink:
        out.append(
            f"parallel.cp = {p.cp} on {c.gpu}, a PCIe-only GPU: every K/V transfer crosses the "
            "PCIe bus (and the network beyond a node); expect CP to be communication-bound. "
            "Prefer fewer, larger-memory GPUs per CP group, or Ulysses to send less."
        )
    elif p.cp > 1 and c.gpu != "cpu" and cp_span > spec.nvlink_domain:
        out.append(
            f"the CP group (tp x cp = {cp_span} ranks) spans beyond the NVLink domain "
            f"({spec.nvlink_domain} GPUs): K/V traffic crosses the inter-node network."
        )
    if p.cp > 1 and p.cp_algorithm == "ring" and cp_span > c.gpus_per_node and c.nodes > 1:
        kv_per_tp = max(spec.model.kv_heads // p.tp, 1)
        heads_per_tp = max(spec.model.heads // p.tp, 1)
        inner = _largest_common_divisor_at_most(
            (p.cp, heads_per_tp, kv_per_tp), c.gpus_per_node // p.tp
        )
        if inner > 1:
            out.append(
                f"the ring CP group ({p.cp} ranks) is wider than a node ({c.gpus_per_node} "
                f"GPUs) while Ulysses would fit in one: consider cp_algorithm: hybrid with "
                f"ulysses_degree: {inner} (all-to-all inside the node, ring of "
                f"{p.cp // inner} across nodes)."
            )
    out += p.deprecations
    if p.cp_sharding == "contiguous" and p.cp > 1:
        out.append(
            "cp_sharding contiguous with causal attention leaves CP ranks unbalanced (rank N-1 does "
            "N times rank 0's work); zigzag balances it."
        )
    out += [
        f"{missing} on this machine; the trainer needs it where it runs"
        for missing in spec.training.data.missing_files()
    ]
    init_from = spec.model.init_from
    if init_from is not None and not (Path(init_from) / CONFIG_FILE).is_file():
        out.append(
            f"model.init_from {init_from}: no {CONFIG_FILE} on this machine; the shape "
            "the spec gives is used here, and the trainer checks it against the "
            "checkpoint where it runs"
        )
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _largest_common_divisor_at_most(values: tuple[int, ...], limit: int) -> int:
    """The largest d <= limit dividing every value (at least 1)."""
    for d in range(max(min(limit, *values), 1), 0, -1):
        if all(v % d == 0 for v in values):
            return d
    return 1
