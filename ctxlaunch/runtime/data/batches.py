# Shapes: a sequence is seq_len + 1 tokens (inputs [:-1], targets [1:]); a micro-batch on one
# rank is (micro_batch, seq_len / CP) tokens at the positions its CP shard holds.
"""Training tokens, and which of them each rank sees.

Sequences are numbered: step k's global batch is sequences k*G .. k*G+G-1 (G = global batch),
so every layout (any DP, CP or gradient accumulation) trains on exactly the same tokens, and a
resumed run continues where the interrupted one stopped without any data-loader state.

Under the balanced CP sharding the tokens a rank holds depend on each sequence's documents:
they are chosen here, as the batch is loaded (`CpShard`), and every per-token tensor of the
batch (tokens, targets, positions) is taken at the same positions (`take_tokens`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from ctxlaunch.contract.spec import DataSpec
from ctxlaunch.cp import shard_positions
from ctxlaunch.cp.documents import CuSeqlens

if TYPE_CHECKING:
    from ctxlaunch.runtime.data.packing import PackedSequence, PackedTokens


class SyntheticTokens:
    """Seeded sequences with structure at two ranges: the first half is a walk on a sparse
    random bigram chain (each token has 4 likely successors; learnable by any model), the second
    half repeats the first (learnable only by attending half a sequence back, across CP shards).

    The walk is generated once (one long chain); each sequence takes a seeded window of it, so
    producing a 1M-token sequence costs a slice, not a million Python steps.
    """

    successors = 4

    def __init__(self, vocab: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.half = (seq_len + 2) // 2
        rng = random.Random(seed)
        table = [[rng.randrange(vocab) for _ in range(self.successors)] for _ in range(vocab)]
        chain = [rng.randrange(vocab)]
        for _ in range(max(1 << 16, 2 * self.half) - 1):
            chain.append(table[chain[-1]][rng.randrange(self.successors)])
        self.chain = torch.tensor(chain, dtype=torch.long)

    def sequence(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.chain.numel() - self.half + 1, (1,), generator=generator))
        first = self.chain[start : start + self.half]
        return torch.cat([first, first])[: self.seq_len + 1]


class ByteText:
    """A text file read byte-level: one token per byte; sequence i starts at byte
    (i * seq_len) modulo what fits."""

    def __init__(self, path: str | Path, seq_len: int):
        self.data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        self.seq_len = seq_len
        if self.data.numel() < seq_len + 1:
            raise ValueError(
                f"training.data.path {path}: {self.data.numel()} bytes is shorter "
                f"than one sequence (seq_len + 1 = {seq_len + 1})"
            )
        self.starts = self.data.numel() - seq_len

    def sequence(self, index: int) -> torch.Tensor:
        start = (index * self.seq_len) % self.starts
        return self.data[start : start + self.seq_len + 1].long()


IGNORE_INDEX = -100
"""The target of a token that is not predicted (cross-entropy's default ignore_index)."""


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor  # (B, S_local)
    targets: torch.Tensor  # (B, S_local); IGNORE_INDEX where a target opens the next document
    positions: torch.Tensor
    """RoPE positions: (S_local,) global positions, or (B, S_local): restarted at each
    document, or per sequence (the balanced sharding places each sequence's tokens)."""
    documents: tuple[tuple[int, ...], ...] | None = None
    """Under a document mask: per sequence, the global document boundaries (0, ..., seq_len)
    of its inputs, what the CP attention functions take; None: no mask."""

    @property
    def predicted_tokens(self) -> int:
        """How many of this rank's targets are predicted (not IGNORE_INDEX: under a document
        mask or a loss mask some are not)."""
        return int((self.targets != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class CpShard:
    """Which tokens of each sequence this CP rank holds."""

    rank: int
    size: int
    sharding: str

    def positions(self, seq_len: int, documents: CuSeqlens | None = None) -> torch.Tensor:
        """The global positions of the tokens held, in shard order: (S/N,), or (B, S/N) where
        the balanced sharding places each sequence by its ``documents``."""
        return shard_positions(seq_len, self.rank, self.size, self.sharding, documents=documents)


def take_tokens(per_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A (B, S) per-token tensor at a shard's ``positions``: (S/N,) for every sequence, or
    (B, S/N) one row per sequence. Every per-token field of a batch goes through here."""
    if positions.dim() == 1:
        return per_token[:, positions].contiguous()
    return per_token.gather(1, positions)


TokenSource: TypeAlias = "SyntheticTokens | ByteText | PackedTokens"
"""Where a run's sequences come from: `sequence(i)` gives sequence i (seq_len + 1 tokens)."""


class Batches:
    """This rank's micro-batches. With `document_mask` (a source of packed documents) each
    carries its document boundaries, ignores the targets that open the next document and,
    with `restart_positions`, numbers positions from 0 in each document. A loss-masked source
    (training.data.loss_mask) ignores the targets its mask leaves out, before the sequence is
    split, so every CP shard, TP rank and pipeline stage reads the same targets."""

    def __init__(
        self,
        source: TokenSource,
        *,
        seq_len: int,
        micro_batch: int,
        global_batch: int,
        dp: int,
        dp_rank: int,
        cp: int,
        cp_rank: int,
        cp_sharding: str,
        document_mask: bool = False,
        restart_positions: bool = True,
    ):
        self.source = source
        self.micro_batch, self.global_batch = micro_batch, global_batch
        self.dp, self.dp_rank = dp, dp_rank
        self.shard = CpShard(cp_rank, cp, cp_sharding)
        self.positions = self.shard.positions(seq_len)
        self._packed: Callable[[int], PackedSequence] | None = getattr(source, "packed", None)
        if document_mask and self._packed is None:
            raise ValueError(
                "training.data.document_mask needs a source of packed documents (source: tokens)"
            )
        self.document_mask, self.restart_positions = document_mask, restart_positions

    def get(self, step: int, micro: int) -> MicroBatch:
        first = (
            step * self.global_batch
            + micro * self.micro_batch * self.dp
            + self.dp_rank * self.micro_batch
        )
        indices = range(first, first + self.micro_batch)
        if self.document_mask and self._packed is not None:
            return self._masked([self._packed(i) for i in indices])
        if self._packed is not None:
            packed = [self._packed(i) for i in indices]
            sequences = torch.stack([torch.from_numpy(p.tokens) for p in packed])
            inputs, targets = sequences[:, :-1], sequences[:, 1:].clone()
            apply_loss_mask(targets, [p.loss_mask for p in packed])
        else:
            sequences = torch.stack([self.source.sequence(i) for i in indices])
            inputs, targets = sequences[:, :-1], sequences[:, 1:]
        return MicroBatch(
            tokens=inputs[:, self.positions].contiguous(),
            targets=targets[:, self.positions].contiguous(),
            positions=self.positions,
        )

    def _masked(self, packed: list[PackedSequence]) -> MicroBatch:
        return masked_micro_batch(
            [torch.from_numpy(p.tokens) for p in packed],
            [torch.from_numpy(p.document_ids) for p in packed],
            self.shard,
            self.restart_positions,
            [p.loss_mask for p in packed],
        )


def apply_loss_mask(targets: torch.Tensor, loss_masks: Sequence[Any | None]) -> None:
    """Set to IGNORE_INDEX, in place, the targets (B, seq_len: target i is token i + 1) whose
    token each sequence's loss mask (seq_len + 1 entries per token, or None) leaves out."""
    for row, mask in enumerate(loss_masks):
        if mask is not None:
            keep = torch.as_tensor(mask[1:], dtype=torch.bool)
            targets[row, ~keep] = IGNORE_INDEX


def masked_micro_batch(
    sequences: list[torch.Tensor],
    document_ids: list[torch.Tensor],
    shard: CpShard | torch.Tensor,
    restart_positions: bool,
    loss_masks: Sequence[Any | None] = (),
) -> MicroBatch:
    """A document-masked micro-batch of whole sequences (seq_len + 1 tokens, with each token's
    document id), at the positions `shard` holds of each (a CP rank's shard, or the positions
    themselves): document boundaries, targets that open the next document ignored (and those
    the sequences' loss masks leave out), positions
    restarted per document if asked."""
    tokens, ids = torch.stack(sequences), torch.stack(document_ids)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    apply_loss_mask(targets, loss_masks)
    # A target from the next document is not predicted (nothing before it in its own
    # document to predict it from).
    targets[ids[:, 1:] != ids[:, :-1]] = IGNORE_INDEX
    own = ids[:, :-1]
    opens = torch.ones_like(own, dtype=torch.bool)
    opens[:, 1:] = own[:, 1:] != own[:, :-1]
    seq_len = own.size(1)
    documents = tuple(tuple(row.nonzero().flatten().tolist()) + (seq_len,) for row in opens)
    held = shard.positions(seq_len, documents) if isinstance(shard, CpShard) else shard
    positions = held
    if restart_positions:
        index = torch.arange(seq_len).expand_as(own)
        start = torch.where(opens, index, 0).cummax(dim=1).values
        positions = take_tokens(index - start, held)
    return MicroBatch(
        tokens=take_tokens(inputs, held),
        targets=take_tokens(targets, held),
        positions=positions,
        documents=documents,
    )


def make_source(data_spec: DataSpec, vocab: int, seq_len: int, seed: int) -> TokenSource:
    """The token source the spec's training.data names."""
    if data_spec.source == "text":
        if data_spec.path is None:  # DataSpec refuses this; the check is for the type
            raise ValueError("data.source = text needs data.path")
        return ByteText(data_spec.path, seq_len)
    if data_spec.source == "tokens":
        from ctxlaunch.runtime.data.packing import PackedTokens

        paths = data_spec.paths or ([data_spec.path] if data_spec.path else [])
        return PackedTokens(
            paths,
            data_spec.weights,
            seq_len,
            vocab,
            data_spec.eval_fraction,
            data_spec.loss_mask,
        )
    return SyntheticTokens(vocab, seq_len, seed)
