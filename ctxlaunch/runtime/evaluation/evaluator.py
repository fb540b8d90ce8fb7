# Shapes: an evaluation sequence is seq_len + 1 tokens (inputs [:-1], targets [1:]), scored on
# each rank at the positions its CP shard holds, one sequence per forward (micro-batch 1).
"""Evaluation at length: loss and perplexity per context-length bucket on held-out data, and
the passkey-retrieval probe, forward only, at the job's own layout. What is scored comes from
ctxlaunch.runtime.evaluation.eval_data; the result is a ctxlaunch.runtime.records.EvalResult.

Work is split as in training: the CP ranks of a DP replica share each sequence, replicas take
every dp-th one; every replica runs the same number of forwards (FSDP all-gathers across
them), the padding ones counted nowhere. Sums are reduced once at the end over the job, TP
ranks (which score the same tokens) counted once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ctxlaunch.cp import shard_positions
from ctxlaunch.runtime.evaluation.eval_data import (
    bucket_edges,
    held_out,
    passkey_grid,
    passkey_probe,
)
from ctxlaunch.runtime.records import Bucket, EvalResult, PasskeyCell

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.parallel.context import ParallelContext


class Evaluator:
    """Scores the held-out sequences and the passkey probes with `model` (this rank's part of
    it, at the context's layout)."""

    def __init__(
        self, spec: JobSpec, ctx: ParallelContext, model: Transformer, device: torch.device
    ):
        if ctx.dims.pp > 1:
            raise ValueError(
                "evaluation runs forward only without a pipeline schedule: it "
                "needs parallel.pp = 1 (checkpoints load at any layout: --set "
                "parallel.pp=1)"
            )
        self.spec, self.ctx, self.model, self.device = spec, ctx, model, device
        training = spec.training
        self.seq_len = training.seq_len
        self.edges = bucket_edges(training.seq_len, training.eval.buckets)
        data = held_out(spec)
        self.sequences, self.data = data.sequences, data.source
        self.document_ids = data.document_ids if training.data.document_mask else None
        self.loss_masks = data.loss_masks
        self.restart_positions = training.data.restart_positions
        self.passkey_note = data.passkey_note
        # The passkey grid, (length, depth, key) per probe: each prompt is built as it is
        # scored, so the prompts of a large grid are never all held at once.
        self.probes: list[tuple[int, float, int]] = []
        self.encode = data.encode
        if training.eval.passkey.enabled and data.encode is not None:
            self.probes = passkey_grid(spec)
            # A length too short for the prompt is refused now, not half-way through an eval.
            for length in dict.fromkeys(length for length, _, _ in self.probes):
                passkey_probe(data.encode, length, 0.0, 10_000)
        elif not training.eval.passkey.enabled:
            self.passkey_note = "disabled (training.eval.passkey.enabled: false)"
        self.positions = shard_positions(
            training.seq_len, ctx.cp_rank, ctx.dims.cp, ctx.dims.cp_sharding
        )
        self.cp_shard = (ctx.cp_rank, ctx.dims.cp, ctx.dims.cp_sharding)
        self.autocast_dtype = torch.bfloat16 if spec.model.dtype == "bf16" else None

    def _mine(self, count: int) -> list[int | None]:
        """The items this DP replica scores, None for the padding forwards that keep every
        replica at the same count."""
        per_replica = -(-count // self.ctx.dims.dp)
        return [
            i if i < count else None
            for i in range(self.ctx.dp_rank, per_replica * self.ctx.dims.dp, self.ctx.dims.dp)
        ]

    def _score(
        self,
        sequence: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token (loss, hit, predicted, context length) of this rank's shard of one
        sequence; under a document mask attention stays in each document, the targets that
        open the next are not predicted, and context lengths restart (restart_positions);
        a loss mask leaves out the targets it does not mark."""
        from ctxlaunch.runtime.data.batches import (
            CpShard,
            MicroBatch,
            apply_loss_mask,
            masked_micro_batch,
        )

        if document_ids is not None:
            batch = masked_micro_batch(
                [sequence],
                [document_ids],
                CpShard(*self.cp_shard),
                self.restart_positions,
                [loss_mask],
            )
        else:
            targets = sequence[1:].clone().unsqueeze(0)
            apply_loss_mask(targets, [loss_mask])
            batch = MicroBatch(
                tokens=sequence[:-1][self.positions].unsqueeze(0),
                targets=targets[:, self.positions],
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
        """Score every held-out sequence and probe; the result over the whole job (every rank
        returns the same)."""
        counts = self.ctx.tp_rank == 0  # TP ranks score the same tokens: count them once
        bucket_count = len(self.edges) - 1
        sums = torch.zeros(2, bucket_count, dtype=torch.float64)  # loss sum, tokens
        inner_edges = torch.tensor(self.edges[1:-1])
        for index in self._mine(len(self.sequences)):
            chosen = index if index is not None else 0
            loss, _, predicted, context = self._score(
                self.sequences[chosen],
                self.document_ids[chosen] if self.document_ids is not None else None,
                self.loss_masks[chosen] if self.loss_masks is not None else None,
            )
            if index is not None and counts:
                bucket_of = torch.bucketize(context, inner_edges, right=True)
                sums[0].index_add_(0, bucket_of, (loss * predicted).double())
                sums[1].index_add_(0, bucket_of, predicted.double())
        probe_sums = torch.zeros(2, len(self.probes), dtype=torch.float64)  # hits, answer tokens
        for index in self._mine(len(self.probes)):
            assert self.encode is not None  # a grid is made only with an encoder
            probe = passkey_probe(self.encode, *self.probes[index if index is not None else 0])
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
        for length, depth in dict.fromkeys((p[0], p[1]) for p in self.probes):
            members = [i for i, p in enumerate(self.probes) if (p[0], p[1]) == (length, depth)]
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
