"""What evaluation scores: the held-out sequences of the spec's data, the passkey-retrieval
prompts, and the context-length buckets the loss is reported in.

Why per bucket: a model whose long context is used predicts late tokens better than early
ones (the loss falls with the context length); a model that ignores it shows a flat curve,
and one whose positions are broken past its training length shows the loss rising there.
A token's context length is its RoPE position.

The passkey probe (Mohtashami & Jaggi, 2023, "Landmark Attention"; the prompt LongLoRA and
YaRN report) hides a five-digit number at a depth of filler text and asks for it at the end.
It is scored teacher-forced (ctxlaunch.runtime.evaluation.evaluator): the probe is retrieved when
the model's arg-max at every token of the answer is that token, so a probe costs one forward
pass, not a generation loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.data.packing import PackedFile

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
    for halvings in range(buckets - 1, -1, -1):
        edge = seq_len >> halvings
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


def passkey_grid(spec: JobSpec) -> list[tuple[int, float, int]]:
    """Every probe of the spec as (length, depth, key): each length x depth x trial, keys
    seeded by the three. A probe's prompt is built from these when it is scored
    (`passkey_probe`), so a grid holds no prompt it is not scoring."""
    passkey, seq_len = spec.training.eval.passkey, spec.training.seq_len
    lengths = passkey.lengths or sorted({max(seq_len // 4, 1), max(seq_len // 2, 1), seq_len})
    grid = []
    for length in lengths:
        for depth in passkey.depths:
            for trial in range(passkey.trials):
                key = random.Random(f"{spec.training.seed}/{length}/{depth}/{trial}").randrange(
                    10_000, 100_000
                )
                grid.append((length, depth, key))
    return grid


def passkey_probes(spec: JobSpec, encode: Callable[[str], list[int]]) -> list[PasskeyProbe]:
    """Every probe of the spec, built (`passkey_grid`'s, in its order)."""
    return [passkey_probe(encode, *cell) for cell in passkey_grid(spec)]


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
    loss_masks: list[torch.Tensor] | None = None
    """Each sequence's per-token loss mask (training.data.loss_mask), else None."""


def held_out(spec: JobSpec) -> HeldOut:
    """The evaluation sequences the spec's data section gives, and a text encoder."""
    from ctxlaunch.runtime.data.batches import ByteText, SyntheticTokens

    training = spec.training
    data, seq_len, count = training.data, training.seq_len, training.eval.sequences
    if data.source == "synthetic":
        synthetic = SyntheticTokens(spec.model.vocab, seq_len, training.seed)
        sequences = [synthetic.sequence(EVAL_SEQUENCE_OFFSET + i) for i in range(count)]
        return HeldOut(
            sequences,
            "synthetic sequences no step trains on",
            None,
            "synthetic tokens carry no text: no passkey probe",
        )
    if data.source == "text":
        assert data.path is not None  # DataSpec requires it
        text = ByteText(data.path, seq_len)
        sequences = [text.sequence(i) for i in range(count)]
        return HeldOut(
            sequences,
            "the text file's first sequences (byte-level text has no "
            "held-out split: these are trained on too)",
            lambda s: list(s.encode("utf-8")),
        )
    return _held_out_documents(spec)


def _held_out_documents(spec: JobSpec) -> HeldOut:
    from ctxlaunch.runtime.data.packing import PackedFile

    training = spec.training
    data, seq_len, evaluation = training.data, training.seq_len, training.eval
    if data.eval_fraction <= 0:
        raise ValueError(
            "training.data.eval_fraction is 0: no documents are held out for "
            "evaluation; set it (e.g. 0.01; the split is by a fixed hash of each "
            "document's index, so training on the rest never sees them)"
        )
    paths = data.paths or ([data.path] if data.path else [])
    streams = [
        _document_windows(PackedFile(path, seq_len, data.eval_fraction, data.loss_mask))
        for path in paths
    ]
    # Round-robin over the files, up to the count asked for.
    windows = [w for group in _interleave(streams) for w in group][: evaluation.sequences]
    sequences = [tokens for tokens, _, _ in windows]
    if not sequences:
        raise ValueError(
            f"training.data: the held-out documents (eval_fraction "
            f"{data.eval_fraction}) hold fewer than seq_len + 1 = {seq_len + 1} "
            "tokens; raise eval_fraction or lower training.seq_len"
        )
    encode, note = None, None
    if evaluation.tokenizer is None:
        note = "no training.eval.tokenizer: no passkey probe"
    else:
        from ctxlaunch.runtime.data.tokenizers import load_tokenizer

        encode = load_tokenizer(evaluation.tokenizer).encode
    return HeldOut(
        sequences,
        f"{len(sequences)} sequences of held-out documents",
        encode,
        note,
        [ids for _, ids, _ in windows],
        [mask for _, _, mask in windows] if data.loss_mask else None,
    )


Window = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A held-out window: seq_len + 1 token ids, their document ids, their loss mask (all True
for a file without one)."""


def _document_windows(packed: PackedFile) -> list[Window]:
    """The held-out documents of one packed file, end to end, cut into seq_len + 1 windows a
    seq_len apart: (token ids, document ids, loss mask) each."""
    seq_len = packed.seq_len
    held = list(packed.eval_documents())
    tokens = (
        torch.cat([torch.from_numpy(doc_tokens.astype("int64")) for _, doc_tokens in held])
        if held
        else torch.zeros(0, dtype=torch.long)
    )
    ids = (
        torch.cat(
            [torch.full((len(doc_tokens),), doc, dtype=torch.long) for doc, doc_tokens in held]
        )
        if held
        else torch.zeros(0, dtype=torch.long)
    )
    masks = [packed.loss_mask_of(doc) for doc, _ in held]
    mask = (
        torch.cat(
            [
                torch.ones(len(doc_tokens), dtype=torch.bool)
                if m is None
                else torch.from_numpy(m.copy())
                for (_, doc_tokens), m in zip(held, masks, strict=True)
            ]
        )
        if held
        else torch.zeros(0, dtype=torch.bool)
    )
    return [
        (tokens[i : i + seq_len + 1], ids[i : i + seq_len + 1], mask[i : i + seq_len + 1])
        for i in range(0, tokens.numel() - seq_len, seq_len)
    ]


def _interleave(streams: list[list[Window]]) -> list[list[Window]]:
    longest = max((len(s) for s in streams), default=0)
    return [[s[i] for s in streams if i < len(s)] for i in range(longest)]
