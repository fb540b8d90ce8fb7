# Shapes: an evaluation sequence is seq_len + 1 tokens (inputs [:-1], targets [1:]), scored on
# each rank at the positions its CP shard holds, one sequence per forward (micro-batch 1).
"""Evaluation at length: loss and perplexity per context-length bucket on held-out data, and
the passkey-retrieval probe, forward only, at the job's own layout.

Why per bucket: a model whose long context is used predicts late tokens better than early
ones (the loss falls with the context length); a model that ignores it shows a flat curve,
and one whose positions are broken past its training length shows the loss rising there.
A token's context length is its RoPE position.

The passkey probe (Mohtashami & Jaggi, 2023, "Landmark Attention"; the prompt LongLoRA and
YaRN report) hides a five-digit number at a depth of filler text and asks for it at the end.
It is scored teacher-forced: the probe is retrieved when the model's arg-max at every token
of the answer is that token, so a probe costs one forward pass, not a generation loop.

Work is split as in training: the CP ranks of a DP replica share each sequence, replicas take
every dp-th one; every replica runs the same number of forwards (FSDP all-gathers across
them), the padding ones counted nowhere. Sums are reduced once at the end over the job, TP
ranks (which score the same tokens) counted once.

`python -m ctxlaunch.runtime.trainer.evaluate` is one rank of `ctxlaunch eval` (torchrun
starts it): it loads the newest checkpoint (or --checkpoint) at the spec's layout, evaluates,
and rank 0 writes the result as JSON to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ctxlaunch.cp import shard_positions

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.trainer.model import Transformer
    from ctxlaunch.runtime.trainer.parallelize import ParallelContext

EVAL_SEQUENCE_OFFSET = 1 << 40
"""Synthetic data has no held-out split: evaluation draws sequences from this index on, which
no run trains on (a step would need 2^40 sequences before it)."""

PASSKEY_PREFIX = (
    "There is an important piece of information hidden inside a lot of "
    "irrelevant text. Find it and memorize it. I will quiz you about it. "
)
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def passkey_needle(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def bucket_edges(seq_len: int, buckets: int) -> list[int]:
    """Context-length bucket edges doubling up to seq_len: [0, seq_len/2^(n-1), ..., seq_len]
    (fewer buckets where seq_len is too short to halve that often)."""
    edges = [0]
    for k in range(buckets - 1, -1, -1):
        edge = seq_len >> k
        if edge > edges[-1]:
            edges.append(edge)
    return edges


# -- the passkey prompts -------------------------------------------------------------------------
@dataclass(frozen=True)
class PasskeyProbe:
    length: int
    depth: float
    key: int
    tokens: list[int]
    """The prompt, `length` tokens, ending with the answer."""
    answer_tokens: int
    """How many tokens at the end of `tokens` are the answer (the number)."""

    @property
    def answer_targets(self) -> range:
        """Indices into the targets (targets[i] = tokens[i + 1]) that are the answer."""
        start = len(self.tokens) - self.answer_tokens
        return range(start - 1, len(self.tokens) - 1)


def passkey_probe(
    encode: Callable[[str], list[int]], length: int, depth: float, key: int
) -> PasskeyProbe:
    """A prompt of exactly `length` tokens: instructions, filler with the needle at `depth`
    of it, the question and the answer."""
    prefix, needle = encode(PASSKEY_PREFIX), encode(passkey_needle(key))
    question, answer = encode(PASSKEY_QUESTION), encode(f" {key}")
    room = length - len(prefix) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ValueError(
            f"a passkey prompt needs at least {length - room} tokens with this "
            f"tokenizer; training.eval.passkey.lengths has {length}"
        )
    filler_piece = encode(PASSKEY_FILLER)
    filler = (filler_piece * (room // max(len(filler_piece), 1) + 1))[:room]
    before = round(depth * room)
    tokens = prefix + filler[:before] + needle + filler[before:] + question + answer
    return PasskeyProbe(length, depth, key, tokens, len(answer))


def passkey_probes(spec: JobSpec, encode: Callable[[str], list[int]]) -> list[PasskeyProbe]:
    """Every probe of the spec: each length x depth x trial, keys seeded by the three."""
    e, seq_len = spec.training.eval.passkey, spec.training.seq_len
    lengths = e.lengths or sorted({max(seq_len // 4, 1), max(seq_len // 2, 1), seq_len})
    probes = []
    for length in lengths:
        for depth in e.depths:
            for trial in range(e.trials):
                key = random.Random(f"{spec.training.seed}/{length}/{depth}/{trial}").randrange(
                    10_000, 100_000
                )
                probes.append(passkey_probe(encode, length, depth, key))
    return probes


# -- held-out data --------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldOut:
    sequences: list[torch.Tensor]
    """seq_len + 1 token ids each."""
    source: str
    """What they are: held-out documents, or why they are not held out."""
    encode: Callable[[str], list[int]] | None
    """Text to token ids for the passkey prompts, or None (then `passkey_note` says why)."""
    passkey_note: str | None = None
    document_ids: list[torch.Tensor] | None = None
    """Each sequence's per-token document ids (source: tokens), for document masks."""


def held_out(spec: JobSpec) -> HeldOut:
    """The evaluation sequences the spec's data section gives, and a text encoder."""
    from ctxlaunch.runtime.trainer.batches import ByteText, SyntheticTokens

    t, e = spec.training, spec.training.eval
    data, seq_len = t.data, t.seq_len
    if data.source == "synthetic":
        synthetic = SyntheticTokens(spec.model.vocab, seq_len, t.seed)
        sequences = [synthetic.sequence(EVAL_SEQUENCE_OFFSET + i) for i in range(e.sequences)]
        return HeldOut(
            sequences,
            "synthetic sequences no step trains on",
            None,
            "synthetic tokens carry no text: no passkey probe",
        )
    if data.source == "text":
        assert data.path is not None  # DataSpec requires it
        text = ByteText(data.path, seq_len)
        sequences = [text.sequence(i) for i in range(e.sequences)]
        return HeldOut(
            sequences,
            "the text file's first sequences (byte-level text has no "
            "held-out split: these are trained on too)",
            lambda s: list(s.encode("utf-8")),
        )
    return _held_out_documents(spec)


def _held_out_documents(spec: JobSpec) -> HeldOut:
    from ctxlaunch.runtime.data.packing import PackedFile

    t, e = spec.training, spec.training.eval
    data, seq_len = t.data, t.seq_len
    if data.eval_fraction <= 0:
        raise ValueError(
            "training.data.eval_fraction is 0: no documents are held out for "
            "evaluation; set it (e.g. 0.01; the split is by a fixed hash of each "
            "document's index, so training on the rest never sees them)"
        )
    paths = data.paths or ([data.path] if data.path else [])
    streams = []
    for path in paths:
        held = list(PackedFile(path, seq_len, data.eval_fraction).eval_documents())
        tokens = (
            torch.cat([torch.from_numpy(t.astype("int64")) for _, t in held])
            if held
            else torch.zeros(0, dtype=torch.long)
        )
        ids = (
            torch.cat([torch.full((len(t),), d, dtype=torch.long) for d, t in held])
            if held
            else torch.zeros(0, dtype=torch.long)
        )
        streams.append(
            [
                (tokens[i : i + seq_len + 1], ids[i : i + seq_len + 1])
                for i in range(0, tokens.numel() - seq_len, seq_len)
            ]
        )
    # Round-robin over the files, up to the count asked for.
    windows = [w for group in _interleave(streams) for w in group][: e.sequences]
    sequences = [tokens for tokens, _ in windows]
    if not sequences:
        raise ValueError(
            f"training.data: the held-out documents (eval_fraction "
            f"{data.eval_fraction}) hold fewer than seq_len + 1 = {seq_len + 1} "
            "tokens; raise eval_fraction or lower training.seq_len"
        )
    encode, note = None, None
    if e.tokenizer is None:
        note = "no training.eval.tokenizer: no passkey probe"
    else:
        from ctxlaunch.runtime.data.tokenizers import load_tokenizer

        encode = load_tokenizer(e.tokenizer).encode
    return HeldOut(
        sequences,
        f"{len(sequences)} sequences of held-out documents",
        encode,
        note,
        [ids for _, ids in windows],
    )


def _interleave(
    streams: list[list[tuple[torch.Tensor, torch.Tensor]]],
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    longest = max((len(s) for s in streams), default=0)
    return [[s[i] for s in streams if i < len(s)] for i in range(longest)]


# -- results -------------------------------------------------------------------------------------
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


# -- the evaluator -------------------------------------------------------------------------------
class Evaluator:
    """Scores the held-out sequences and the passkey probes with `model` (this rank's part of
    it, at the context's layout)."""

    def __init__(
        self, spec: JobSpec, ctx: ParallelContext, model: Transformer, device: torch.device
    ):
        if ctx.pp > 1:
            raise ValueError(
                "evaluation runs forward only without a pipeline schedule: it "
                "needs parallel.pp = 1 (checkpoints load at any layout: --set "
                "parallel.pp=1)"
            )
        self.spec, self.ctx, self.model, self.device = spec, ctx, model, device
        t = spec.training
        self.seq_len = t.seq_len
        self.edges = bucket_edges(t.seq_len, t.eval.buckets)
        data = held_out(spec)
        self.sequences, self.data = data.sequences, data.source
        self.document_ids = data.document_ids if t.data.document_mask else None
        self.restart_positions = t.data.restart_positions
        self.passkey_note = data.passkey_note
        self.probes: list[PasskeyProbe] = []
        if t.eval.passkey.enabled and data.encode is not None:
            self.probes = passkey_probes(spec, data.encode)
        elif not t.eval.passkey.enabled:
            self.passkey_note = "disabled (training.eval.passkey.enabled: false)"
        self.positions = shard_positions(t.seq_len, ctx.cp_rank, ctx.cp, ctx.cp_sharding)
        self.autocast_dtype = torch.bfloat16 if spec.model.dtype == "bf16" else None

    def _mine(self, count: int) -> list[int | None]:
        """The items this DP replica scores, None for the padding forwards that keep every
        replica at the same count."""
        per_replica = -(-count // self.ctx.dp)
        return [
            i if i < count else None
            for i in range(self.ctx.dp_rank, per_replica * self.ctx.dp, self.ctx.dp)
        ]

    def _score(
        self, sequence: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token (loss, hit, predicted, context length) of this rank's shard of one
        sequence; under a document mask attention stays in each document, the targets that
        open the next are not predicted, and context lengths restart (restart_positions)."""
        from ctxlaunch.runtime.trainer.batches import MicroBatch, masked_micro_batch

        if document_ids is not None:
            batch = masked_micro_batch(
                [sequence], [document_ids], self.positions, self.restart_positions
            )
        else:
            batch = MicroBatch(
                tokens=sequence[:-1][self.positions].unsqueeze(0),
                targets=sequence[1:][self.positions].unsqueeze(0),
                positions=self.positions,
            )
        autocast = torch.autocast(
            device_type=self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )
        with torch.no_grad(), autocast:
            loss, hit = self.model(
                batch.tokens.to(self.device),
                batch.positions.to(self.device),
                batch.targets.to(self.device),
                batch.documents,
                scores=True,
            )
        return (
            loss.float().cpu(),
            hit.cpu(),
            batch.targets.flatten() != -100,
            batch.positions.flatten(),
        )

    def _padded(self, tokens: list[int]) -> torch.Tensor:
        """A probe's prompt padded with filler after the answer to seq_len + 1 (causal: what
        follows the answer cannot change its scores)."""
        pad = self.seq_len + 1 - len(tokens)
        return torch.tensor(tokens + tokens[:1] * pad, dtype=torch.long)

    def run(self, step: int | None = None) -> EvalResult:
        counts = self.ctx.tp_rank == 0  # TP ranks score the same tokens: count them once
        n_buckets = len(self.edges) - 1
        sums = torch.zeros(2, n_buckets, dtype=torch.float64)  # loss sum, tokens
        edges = torch.tensor(self.edges[1:-1])
        for index in self._mine(len(self.sequences)):
            chosen = index if index is not None else 0
            loss, _, predicted, context = self._score(
                self.sequences[chosen],
                self.document_ids[chosen] if self.document_ids is not None else None,
            )
            if index is not None and counts:
                bucket_of = torch.bucketize(context, edges, right=True)
                sums[0].index_add_(0, bucket_of, (loss * predicted).double())
                sums[1].index_add_(0, bucket_of, predicted.double())
        probe_sums = torch.zeros(2, len(self.probes), dtype=torch.float64)  # hits, answer tokens
        for index in self._mine(len(self.probes)):
            probe = self.probes[index if index is not None else 0]
            _, hit, _, _ = self._score(self._padded(probe.tokens))
            if index is not None and counts:
                answer = torch.isin(self.positions, torch.tensor(list(probe.answer_targets)))
                probe_sums[0, index] = float(hit[answer].sum())
                probe_sums[1, index] = float(answer.sum())
        if dist.is_initialized() and self.ctx.world_size > 1:
            packed = torch.cat([sums.flatten(), probe_sums.flatten()])
            dist.all_reduce(packed)
            sums = packed[: sums.numel()].view_as(sums)
            probe_sums = packed[sums.numel() :].view_as(probe_sums)
        return self._result(step, sums, probe_sums)

    def _result(self, step: int | None, sums: torch.Tensor, probe_sums: torch.Tensor) -> EvalResult:
        buckets = []
        for i in range(len(self.edges) - 1):
            tokens = int(sums[1, i])
            loss = float(sums[0, i]) / tokens if tokens else float("nan")
            buckets.append(
                Bucket(
                    self.edges[i],
                    self.edges[i + 1],
                    tokens,
                    loss,
                    math.exp(min(loss, 700.0)) if tokens else float("nan"),
                )
            )
        total = int(sums[1].sum())
        loss = float(sums[0].sum()) / total if total else float("nan")
        cells = []
        for length, depth in dict.fromkeys((p.length, p.depth) for p in self.probes):
            members = [
                i for i, p in enumerate(self.probes) if (p.length, p.depth) == (length, depth)
            ]
            hits, answers = probe_sums[0, members], probe_sums[1, members]
            cells.append(
                PasskeyCell(
                    length,
                    depth,
                    len(members),
                    int(((hits == answers) & (answers > 0)).sum()),
                    float(hits.sum() / answers.sum()) if answers.sum() else 0.0,
                )
            )
        return EvalResult(
            step=step,
            sequences=len(self.sequences),
            tokens=total,
            loss=loss,
            perplexity=math.exp(min(loss, 700.0)),
            buckets=buckets,
            passkey=cells,
            passkey_note=self.passkey_note,
            data=self.data,
        )


# -- one rank of `ctxlaunch eval` ---------------------------------------------------------------
def load_weights(
    parts: Any, spec: JobSpec, ctx: ParallelContext, device: torch.device, path: Path
) -> None:
    """This rank's weights from a checkpoint: the layout-independent DCP format at any layout,
    or a DeepSpeed checkpoint (consolidated by DeepSpeed's own zero_to_fp32)."""
    if (path / ".metadata").is_file():
        from ctxlaunch.runtime.trainer.reshard import CheckpointState

        CheckpointState(
            parts.named_parameters(), None, None, parts.plan, ctx.tp, ctx.tp_group, device
        ).load(path)
        return
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ctxlaunch.runtime.trainer.reshard import write_local

    with contextlib.redirect_stdout(sys.stderr):
        state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    with torch.no_grad():
        for name, param in parts.named_parameters():
            if name not in state:
                raise ValueError(
                    f"checkpoint {path} has no weight {name!r}: it was saved by a different model"
                )
            write_local(param, state[name].to(param.dtype))


def checkpoint_to_load(spec: JobSpec, given: str | None) -> Path:
    """--checkpoint, or the newest committed checkpoint in training.checkpoint.dir."""
    from ctxlaunch.runtime.trainer import checkpoint

    if given:
        path = Path(given)
        if not path.is_dir():
            raise ValueError(f"--checkpoint {given}: no such checkpoint directory")
        return path
    directory = spec.training.checkpoint.dir
    step = checkpoint.latest_step(directory)
    if directory is None or step is None:
        raise ValueError(
            f"no checkpoint to evaluate: training.checkpoint.dir is {directory!r} "
            f"and holds no committed step; train first or pass --checkpoint"
        )
    return checkpoint.step_dir(directory, step)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ctxlaunch.runtime.trainer.evaluate",
        description="One rank of `ctxlaunch eval`.",
    )
    parser.add_argument("spec", nargs="?", help="job spec; default: $CTXLAUNCH_SPEC_JSON")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    parser.add_argument("--checkpoint", help="the checkpoint step directory to load")
    parser.add_argument("--out", required=True, help="where rank 0 writes the result (JSON)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from ctxlaunch.contract import exitcodes
    from ctxlaunch.contract.loader import SpecError
    from ctxlaunch.runtime.trainer import distenv
    from ctxlaunch.runtime.trainer.main import SetupError, check_world_size, load_job_spec

    args = parse_args(argv)
    try:
        spec = load_job_spec(args)
        path = checkpoint_to_load(spec, args.checkpoint)
        denv = distenv.detect()
        check_world_size(spec, denv)
    except (SpecError, SetupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exitcodes.BAD_INPUT
    try:
        result = _evaluate(spec, denv, path)
    except ValueError as exc:
        print(f"[rank {denv.rank}] error: {exc}", file=sys.stderr, flush=True)
        return exitcodes.BAD_INPUT
    if denv.rank == 0:
        out = Path(args.out)
        with tempfile.NamedTemporaryFile(
            "w", dir=out.parent, delete=False, suffix=".tmp"
        ) as handle:
            json.dump({"checkpoint": str(path), **result.to_dict()}, handle, indent=2)
        os.replace(handle.name, out)
    return exitcodes.OK


def _evaluate(spec: JobSpec, denv: Any, path: Path) -> EvalResult:
    from ctxlaunch.runtime.trainer.main import join_process_group, rank_context
    from ctxlaunch.runtime.trainer.model import Transformer
    from ctxlaunch.runtime.trainer.parallelize import ParallelSettings, parallelize

    device = join_process_group(spec, denv)
    try:
        ctx = rank_context(spec, denv)
        with torch.device("meta"):
            model = Transformer.from_spec(spec.model)
        settings = ParallelSettings.from_spec(spec)
        if settings.state_engine == "deepspeed":  # forward only: whole weights, no DeepSpeed
            from dataclasses import replace

            settings = replace(settings, state_engine="torch")
        parts = parallelize(model, ctx=ctx, settings=settings, device=device)
        load_weights(parts, spec, ctx, device, path)
        evaluator = Evaluator(spec, ctx, parts.model, device)
        result = evaluator.run()
    finally:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.exit(main())
