"""The chunked loss (loss.py: forward and backward per chunk) against the whole-sequence
cross-entropy of full logits: the value and the gradients of the head's input and weight, at
one process and vocabulary-parallel at TP 2, with ignored targets (-100: document ends, padding)
and the step's predicted-token divisor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxlaunch.runtime.modeling.loss import VocabShard, chunked_cross_entropy
from ctxlaunch.runtime.modeling.model import Transformer
from tests.helpers.dist import run_distributed

TOKENS, HIDDEN, VOCAB, CHUNK = 300, 48, 96, 64  # 300 = 4 full chunks and one of 44


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype) * 0.3
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    targets[::7] = -100  # not predicted
    return hidden, weight, targets


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(hidden, weight)  # the whole (tokens x vocab) logits at once
    logits = logits if logits.dtype == torch.float64 else logits.float()
    loss = F.cross_entropy(logits, targets, reduction="sum") / divisor
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return loss.detach(), hidden.grad, weight.grad


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    divisor: float,
    vocab: VocabShard | None = None,
    upstream: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_cross_entropy(
        hidden, weight, targets, divisor=divisor, chunk_tokens=CHUNK, vocab=vocab
    )
    (loss * upstream).backward()
    assert hidden.grad is not None and weight.grad is not None
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("divisor", [None, 1234.0])
def test_chunked_loss_matches_full_logits_fp32(divisor: float | None) -> None:
    hidden, weight, targets = _inputs()
    divisor = divisor or float((targets != -100).sum())
    want = _reference(hidden, weight, targets, divisor)
    got = _chunked(hidden, weight, targets, divisor)
    for name, g, w in zip(("loss", "d hidden", "d weight"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=name)
    # Ignored targets give their rows no gradient at all.
    assert torch.count_nonzero(got[1][::7]) == 0


def test_chunked_loss_scales_by_the_incoming_gradient() -> None:
    hidden, weight, targets = _inputs()
    base = _chunked(hidden, weight, targets, 100.0)
    scaled = _chunked(hidden, weight, targets, 100.0, upstream=0.25)
    torch.testing.assert_close(scaled[1], base[1] * 0.25)
    torch.testing.assert_close(scaled[2], base[2] * 0.25)


def test_chunked_loss_float64_and_forward_only() -> None:
    hidden, weight, targets = _inputs(torch.float64)
    want = _reference(hidden, weight, targets, 50.0)
    got = _chunked(hidden, weight, targets, 50.0)
    assert got[0].dtype == torch.float64
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        value = chunked_cross_entropy(hidden, weight, targets, divisor=50.0, chunk_tokens=CHUNK)
    torch.testing.assert_close(value, want[0], rtol=1e-12, atol=0)


def test_chunked_loss_under_bf16_autocast() -> None:
    """Matmuls in bf16, softmax in fp32, as the whole-logits loss under autocast does."""
    hidden, weight, targets = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _reference(hidden, weight, targets, 100.0)
        got = _chunked(hidden, weight, targets, 100.0)
    assert got[1].dtype == got[2].dtype == torch.float32
    for name, g, w in zip(("loss", "d hidden", "d weight"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-4, msg=name)


def test_chunked_loss_rejects_a_bad_shape() -> None:
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(hidden, weight, targets[:-1], divisor=1.0, chunk_tokens=CHUNK)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(hidden, weight, targets, divisor=1.0, chunk_tokens=0)


@pytest.mark.parametrize("tie", [False, True])
def test_transformer_loss_matches_full_logits(tie: bool) -> None:
    """Through the model: every parameter's gradient against the whole-logits loss."""
    torch.manual_seed(0)
    model = Transformer(
        layers=2,
        hidden=HIDDEN,
        heads=4,
        kv_heads=2,
        ffn_hidden=64,
        vocab=VOCAB,
        rope_theta=10_000.0,
        norm_eps=1e-5,
        tie_embeddings=tie,
    )
    model.loss_chunk_tokens = CHUNK
    model.loss_divisor = 777.0
    tokens = torch.randint(0, VOCAB, (2, TOKENS // 2))
    targets = torch.randint(0, VOCAB, (2, TOKENS // 2))
    targets[:, 40:45] = -100
    positions = torch.arange(TOKENS // 2)
    loss = model(tokens, positions, targets)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    hidden = model.hidden_states(tokens, positions).flatten(0, 1)
    logits = F.linear(hidden, model._output_weight())
    want_loss = F.cross_entropy(logits, targets.flatten(), reduction="sum") / 777.0
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    assert got.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def _tp_rank(rank: int, world: int) -> tuple[object, ...]:
    import torch.distributed as dist

    hidden, weight, targets = _inputs()
    rows = VOCAB // world
    shard = weight[rank * rows : (rank + 1) * rows]
    vocab = VocabShard(rank * rows, dist.group.WORLD)
    got = _chunked(hidden, shard, targets, 321.0, vocab=vocab)
    # numpy, not tensors: tensors would pass through shared memory that vanishes with the
    # worker process.
    return tuple(t.numpy() for t in got)


@pytest.mark.timeout(180)
def test_vocab_parallel_chunked_loss_matches_full_logits_at_tp2() -> None:
    """Each rank holds half the vocabulary: the same loss on both, the same input gradient
    (the sum of both halves' contributions, as TP's reduce-scatter then gives), and the
    weight shards together the whole weight's gradient."""
    hidden, weight, targets = _inputs()
    want_loss, want_hidden, want_weight = _reference(hidden, weight, targets, 321.0)
    ranks = [[torch.from_numpy(a) for a in r] for r in run_distributed(_tp_rank, 2, timeout_s=150)]
    for loss, _, _ in ranks:
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(ranks[0][1] + ranks[1][1], want_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([r[2] for r in ranks]), want_weight, rtol=1e-5, atol=1e-7)
