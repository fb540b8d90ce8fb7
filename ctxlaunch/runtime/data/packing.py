"""Documents packed into training sequences at fixed offsets, with a held-out split.

Each file's training documents, in file order, make one token stream (every document already
ends with its end-of-document id). Sequence j of a file is stream tokens [j*S, j*S + S + 1)
(S = seq_len; inputs are the first S, targets the last S), wrapping to the start after the
last whole sequence. With several files, sequence i of the blend comes from the file and the
file-sequence that a fixed schedule assigns to i (`BlendSchedule`). So sequence i is a pure
function of i and the files: every layout sees the same tokens and a resumed run needs no
loader state. Each packed sequence carries its per-token document ids, from which document
boundaries (for document masks and restarted positions) follow, and, for a loss-masked dataset
(PREFIX.lossmask), per token whether the loss counts it as a target: the mask is cut with the
tokens, so it stays aligned with them wherever they go.

Held out for evaluation: document d of a file is held out when a seeded 64-bit hash of d falls
below `eval_fraction` of the hash range. The hash (splitmix64 of d xor EVAL_SALT) depends only
on the document's index, never on the training seed or the layout, so the held-out set is the
same in every run over that file, and appending documents never moves earlier ones across the
split.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from ctxlaunch.runtime.data.indexed import IndexedDataset

EVAL_SALT = 0x6A09E667F3BCC908
"""Mixed into each document index before hashing (the first 64 bits of sqrt(2)'s fraction)."""

BLEND_PERIOD = 4096
"""Sequences per blend period: each file gets round(weight x period) of them in each period,
so the realised mix matches the weights to within 1/period."""


def splitmix64(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finaliser: a fast, well-mixed 64-bit hash of each value."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def held_out(document_count: int, eval_fraction: float) -> npt.NDArray[np.bool_]:
    """Which of a file's documents are held out for evaluation (see the module docstring)."""
    if eval_fraction <= 0:
        return np.zeros(document_count, dtype=bool)
    threshold = np.uint64(min(int(eval_fraction * 2.0**64), 2**64 - 1))
    hashes = splitmix64(np.arange(document_count, dtype=np.uint64) ^ np.uint64(EVAL_SALT))
    return hashes < threshold


@dataclass(frozen=True)
class PackedSequence:
    """One training sequence: S + 1 token ids and, per token, the index (in its file) of the
    document it comes from."""

    file: int
    """Which of the source's files it was cut from."""
    tokens: npt.NDArray[np.int64]
    document_ids: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.bool_] | None = None
    """Per token, whether the loss counts it as a target (training.data.loss_mask), else
    None: every target counts."""

    @property
    def document_starts(self) -> npt.NDArray[np.int64]:
        """Offsets in the sequence where a document (or the piece of one that opens the
        sequence) starts; the first is 0."""
        changes = np.flatnonzero(np.diff(self.document_ids)) + 1
        return np.concatenate([np.zeros(1, dtype=np.int64), changes.astype(np.int64)])


class PackedFile:
    """One indexed dataset's training documents as a stream of fixed-offset sequences."""

    def __init__(
        self, path: str | Path, seq_len: int, eval_fraction: float, loss_mask: bool = False
    ):
        self.dataset = IndexedDataset(path)
        self.mask = self.dataset.loss_mask() if loss_mask else None
        self.seq_len = seq_len
        self.held_out = held_out(len(self.dataset), eval_fraction)
        self.train_documents = np.flatnonzero(~self.held_out)
        lengths = self.dataset.document_lengths()[self.train_documents]
        self.stream_starts = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.stream_starts[1:])
        train_tokens = int(self.stream_starts[-1])
        self.sequence_count = (train_tokens - 1) // seq_len if train_tokens else 0
        if self.sequence_count < 1:
            raise ValueError(
                f"training.data {self.dataset.prefix}: {train_tokens} training tokens in "
                f"{lengths.size} documents ({int(self.held_out.sum())} held out) is shorter "
                f"than one sequence (seq_len + 1 = {seq_len + 1})"
            )

    def sequence(
        self, index: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]:
        """Tokens, per-token document ids and (a loss-masked file) per-token loss mask of this
        file's sequence `index` (modulo the sequences it holds)."""
        start = (index % self.sequence_count) * self.seq_len
        stop = start + self.seq_len + 1
        tokens = np.empty(stop - start, dtype=np.int64)
        documents = np.empty(stop - start, dtype=np.int64)
        mask = None if self.mask is None else np.empty(stop - start, dtype=np.bool_)
        k = int(np.searchsorted(self.stream_starts, start, side="right")) - 1
        filled = 0
        while filled < tokens.size:
            doc_start, doc_stop = int(self.stream_starts[k]), int(self.stream_starts[k + 1])
            take_from = max(start + filled, doc_start) - doc_start
            take = min(doc_stop - doc_start - take_from, tokens.size - filled)
            document = int(self.train_documents[k])
            tokens[filled : filled + take] = self.dataset.document(document)[
                take_from : take_from + take
            ]
            documents[filled : filled + take] = document
            if mask is not None and self.mask is not None:
                first = int(self.dataset.document_starts[document]) + take_from
                mask[filled : filled + take] = self.mask[first : first + take] != 0
            filled += take
            k += 1
        return tokens, documents, mask

    def eval_documents(self) -> Iterator[tuple[int, npt.NDArray[np.generic]]]:
        """The held-out documents: (index in the file, token ids)."""
        for document in np.flatnonzero(self.held_out):
            yield int(document), self.dataset.document(int(document))

    def loss_mask_of(self, document: int) -> npt.NDArray[np.bool_] | None:
        """Document `document`'s loss mask (a loss-masked file), else None."""
        if self.mask is None:
            return None
        starts = self.dataset.document_starts
        return self.mask[int(starts[document]) : int(starts[document + 1])] != 0


class BlendSchedule:
    """Which file, and which of its sequences, blend sequence i is: within each period of
    BLEND_PERIOD sequences, file f gets its share in Megatron's error-minimising order (each
    next sequence to the file furthest below weight x sequences so far). The table is built
    once, so sequence i is a lookup, never a replay of the sequences before it."""

    def __init__(self, weights: Sequence[float]):
        shares = np.asarray(weights, dtype=np.float64)
        shares = shares / shares.sum()
        self.period = BLEND_PERIOD
        self.file = np.empty(self.period, dtype=np.int64)
        self.local = np.empty(self.period, dtype=np.int64)
        taken = np.zeros(shares.size, dtype=np.int64)
        for position in range(self.period):
            chosen = int(np.argmax(shares * (position + 1) - taken))
            self.file[position], self.local[position] = chosen, taken[chosen]
            taken[chosen] += 1
        self.per_period = taken

    def __call__(self, index: int) -> tuple[int, int]:
        """(file, that file's sequence number) of blend sequence `index`."""
        period, position = divmod(index, self.period)
        chosen = int(self.file[position])
        return chosen, period * int(self.per_period[chosen]) + int(self.local[position])


class PackedTokens:
    """The trainer's `source: tokens`: `sequence(i)` is blend sequence i as a LongTensor of
    seq_len + 1 ids, `packed(i)` the same with its document ids."""

    def __init__(
        self,
        paths: Sequence[str | Path],
        weights: Sequence[float] | None,
        seq_len: int,
        vocab: int,
        eval_fraction: float = 0.0,
        loss_mask: bool = False,
    ):
        self.files = [PackedFile(p, seq_len, eval_fraction, loss_mask) for p in paths]
        self.schedule = BlendSchedule(weights or [1.0] * len(self.files))
        self.vocab = vocab

    def packed(self, index: int) -> PackedSequence:
        """Blend sequence `index` with its per-token document ids."""
        chosen, local = self.schedule(index)
        tokens, documents, mask = self.files[chosen].sequence(local)
        top = int(tokens.max())
        if top >= self.vocab or int(tokens.min()) < 0:
            raise ValueError(
                f"training.data {self.files[chosen].dataset.prefix}: token id "
                f"{top} is outside model.vocab = {self.vocab}; prepare the data "
                "with the model's tokenizer"
            )
        return PackedSequence(chosen, tokens, documents, mask)

    def sequence(self, index: int) -> torch.Tensor:
        """Blend sequence `index`'s seq_len + 1 token ids."""
        return torch.from_numpy(self.packed(index).tokens)
