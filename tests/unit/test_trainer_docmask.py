"""Document masking in the trainer: packed batches carry document boundaries, restarted
positions and ignored boundary targets; a packed step with `document_mask` trains to the same
losses and gradients at CP 2 (ring and Ulysses, every sharding), CP 4 (ring and hybrid, the
balanced sharding), DP 2, TP 2, PP 2 and DeepSpeed ZeRO-2, with gradient accumulation, as in
one process; and one process's step equals each document run alone through the model,
averaged by token count (multi-process, gloo on CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ctxlaunch.contract.loader import SpecError, apply_overrides, validate_spec
from ctxlaunch.runtime.data.batches import IGNORE_INDEX, Batches
from ctxlaunch.runtime.data.indexed import IndexedWriter, token_dtype
from ctxlaunch.runtime.data.packing import PackedTokens
from tests.helpers.dist import run_distributed
from tests.helpers.trainer_steps import assert_matches_one_process, train_steps

SEQ_LEN = 128


def corpus(tmp_path: Path, documents: int = 120, seed: int = 0, long_every: int = 0) -> str:
    """Documents of 1..60 ids below 256 (the tiny model's vocabulary), each ending in 0; with
    `long_every`, every so many a long one of 100..250 ids (a long tail)."""
    rng = np.random.default_rng(seed)
    prefix = tmp_path / "docs"
    with IndexedWriter(prefix, token_dtype(256)) as writer:
        for index in range(documents):
            long = long_every and index % long_every == long_every - 1
            length = rng.integers(100, 250) if long else rng.integers(1, 60)
            writer.add_document(np.append(rng.integers(1, 256, length), 0))
    return str(prefix)


def spec_for(world: int, prefix: str, **changes) -> dict:
    base = {
        "name": "docmask",
        "model": {"preset": "tiny", "dtype": "fp32"},
        "training": {
            "seq_len": SEQ_LEN,
            "micro_batch": 1,
            "global_batch": 4,
            "steps": 2,
            "seed": 7,
            "optimizer": {"lr": 1e-3, "warmup_steps": 1},
            "data": {"source": "tokens", "path": prefix, "document_mask": True},
        },
        "parallel": {"cp": 1},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": world},
    }
    data = apply_overrides(base, [f"{k}={v}" for k, v in changes.items()])
    return validate_spec(data).model_dump(mode="json")


def test_packed_batches_carry_documents_positions_and_ignored_targets(tmp_path: Path) -> None:
    prefix = corpus(tmp_path)
    source = PackedTokens([prefix], None, seq_len=SEQ_LEN, vocab=256)
    for restart in (True, False):
        for cp, layout in (
            (1, "zigzag"),
            (2, "zigzag"),
            (2, "contiguous"),
            (2, "balanced"),
            (4, "balanced"),
        ):
            shards = [
                Batches(
                    source,
                    seq_len=SEQ_LEN,
                    micro_batch=2,
                    global_batch=4,
                    dp=1,
                    dp_rank=0,
                    cp=cp,
                    cp_rank=r,
                    cp_sharding=layout,
                    document_mask=True,
                    restart_positions=restart,
                ).get(1, 1)
                for r in range(cp)
            ]
            for b in range(2):
                packed = source.packed(6 + b)
                ids = packed.document_ids
                starts = [0] + [j for j in range(1, SEQ_LEN) if ids[j] != ids[j - 1]]
                assert shards[0].documents[b] == tuple(starts) + (SEQ_LEN,)
                want_targets = [
                    int(t) if ids[j + 1] == ids[j] else IGNORE_INDEX
                    for j, t in enumerate(packed.tokens[1:])
                ]
                want_positions = [
                    j - max(s for s in starts if s <= j) if restart else j for j in range(SEQ_LEN)
                ]
                from ctxlaunch.cp import shard_positions

                for r, shard in enumerate(shards):
                    held = shard_positions(SEQ_LEN, r, cp, layout, documents=shard.documents)
                    where = (held[b] if held.dim() == 2 else held).tolist()
                    assert shard.targets[b].tolist() == [want_targets[j] for j in where]
                    assert shard.tokens[b].tolist() == [int(packed.tokens[j]) for j in where]
                    positions = (
                        shard.positions[b] if shard.positions.dim() == 2 else shard.positions
                    )
                    assert positions.tolist() == [want_positions[j] for j in where]
            assert sum(s.predicted_tokens for s in shards) == sum(
                t != IGNORE_INDEX for t in torch.cat([s.targets for s in shards]).flatten().tolist()
            )
    assert IGNORE_INDEX in shards[0].targets  # the corpus's documents are shorter than a sequence


def test_document_mask_needs_packed_documents() -> None:
    base = {
        "name": "x",
        "model": {"preset": "tiny"},
        "training": {"seq_len": 64},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }
    for source in ("synthetic", "text"):
        data = {"source": source, "document_mask": True} | (
            {"path": "x.txt"} if source == "text" else {}
        )
        with pytest.raises(SpecError) as caught:
            validate_spec(base | {"training": {"seq_len": 64, "data": data}})
        assert "training.data.document_mask" in str(caught.value)
        assert "needs data.source = tokens" in str(caught.value)


def _train_all(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [train_steps(rank, world, spec, 2) for spec in specs]


def compare(got: dict, want: dict, what: str) -> float:
    """`assert_matches_one_process`, and each gradient within 1e-5 of its largest entry: the
    tiny model's gradients at initialisation are ~1e-4, where atol alone would let a
    mis-weighted token mean (per-rank means averaged, ~1 % off here) through."""
    _, relative = assert_matches_one_process(got, want, what)
    assert relative <= 1e-5, f"{what}: a gradient differs by {relative:.2e} of its largest entry"
    return relative


LAYOUTS = [
    {"parallel.cp": 2, "parallel.cp_algorithm": "ring"},
    {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "contiguous"},
    {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "balanced"},
    {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
    {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses", "parallel.cp_sharding": "balanced"},
    {},  # DP 2: the two ranks predict different numbers of tokens
    {"parallel.tp": 2},  # the vocabulary-parallel loss ignores the boundary targets
    {"parallel.pp": 2},  # 4 micro-batches through 1F1B, each with its own documents
    {"parallel.cp": 2, "training.zero_stage": 2},  # DeepSpeed ZeRO-2 (engine auto at TP 1 x PP 1)
]


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("restart", [True, False])
def test_packed_step_matches_single_process(tmp_path: Path, restart: bool) -> None:
    prefix = corpus(tmp_path)
    common = {"training.data.restart_positions": restart}
    want = train_steps(0, 1, spec_for(1, prefix, **common), 2)
    specs = [spec_for(2, prefix, **common, **changes) for changes in LAYOUTS]
    got = run_distributed(_train_all, 2, specs, timeout_s=380)[0]
    for changes, result in zip(LAYOUTS, got):
        worst = compare(result, want, str(changes or "dp 2"))
        print(
            f"{changes or 'dp 2'} restart={restart}: worst relative gradient difference {worst:.2e}"
        )


BALANCED_CP4 = [
    {"parallel.cp": 4, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "balanced"},
    {
        "parallel.cp": 4,
        "parallel.cp_algorithm": "hybrid",
        "parallel.ulysses_degree": 2,
        "parallel.cp_sharding": "balanced",
    },
]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_balanced_step_at_cp_4_matches_single_process(tmp_path: Path) -> None:
    """A long-tailed corpus, where the balanced sharding moves documents (checked): ring and
    hybrid at CP 4 train as one process does, and the step reports the group's balance."""
    from ctxlaunch.cp import ring_rank_areas
    from ctxlaunch.cp.balance import balanced_spans, zigzag_spans

    prefix = corpus(tmp_path, long_every=3)
    source = PackedTokens([prefix], None, seq_len=SEQ_LEN, vocab=256)
    moved = 0
    for index in range(8):
        ids = source.packed(index).document_ids[:-1]
        bounds = tuple([0] + [j for j in range(1, SEQ_LEN) if ids[j] != ids[j - 1]] + [SEQ_LEN])
        moved += balanced_spans(bounds, 4) != zigzag_spans(SEQ_LEN, 4)
        zigzag = ring_rank_areas([bounds], SEQ_LEN, 4, "zigzag")
        balanced = ring_rank_areas([bounds], SEQ_LEN, 4, "balanced")
        assert max(balanced) * 4 <= 1.05 * sum(balanced)
        assert max(balanced) <= max(zigzag)
    assert moved >= 4, "the corpus must make the balanced sharding differ from zigzag"
    want = train_steps(0, 1, spec_for(1, prefix), 2)
    # Zigzag named: under a document mask the default sharding is the balanced one.
    zigzag = {"parallel.cp": 4, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "zigzag"}
    layouts = [*BALANCED_CP4, zigzag]
    specs = [spec_for(4, prefix, **changes) for changes in layouts]
    got = run_distributed(_train_all, 4, specs, timeout_s=380)[0]
    for changes, result in zip(layouts, got):
        compare(result, want, str(changes))
    # The step's balance (rank 0's CP group): the balanced sharding holds it, zigzag does not.
    assert all(1.0 <= b <= 1.05 for r in got[:2] for b in r["attention_balance"]), got
    assert max(got[2]["attention_balance"]) > 1.1, got[2]["attention_balance"]


@pytest.mark.distributed
def test_packed_step_is_each_document_alone_averaged_by_tokens(tmp_path: Path) -> None:
    """With restarted positions the first step's loss and gradients (4 micro-batches of
    different predicted-token counts) are those of every document piece of the step's
    sequences run alone through the same initial model, summed and divided by the step's
    predicted-token count: an oracle that shares no normalisation code with the engine."""
    from ctxlaunch.runtime.modeling.model import Transformer

    prefix = corpus(tmp_path)
    spec = validate_spec(spec_for(1, prefix))
    got = train_steps(0, 1, spec.model_dump(mode="json"), 1)
    model = Transformer.from_spec(spec.model)
    model.init_weights(spec.training.seed)
    model.loss_divisor = 1.0  # sums
    source = PackedTokens([prefix], None, seq_len=SEQ_LEN, vocab=256)
    total, count = torch.zeros(()), 0
    for index in range(spec.global_batch):
        packed = source.packed(index)
        tokens, ids = torch.from_numpy(packed.tokens), torch.from_numpy(packed.document_ids)
        targets = torch.where(ids[1:] == ids[:-1], tokens[1:], IGNORE_INDEX)
        bounds = [0] + [j for j in range(1, SEQ_LEN) if ids[j] != ids[j - 1]] + [SEQ_LEN]
        for start, stop in zip(bounds, bounds[1:]):
            piece = targets[None, start:stop]
            total = total + model(tokens[None, start:stop], torch.arange(stop - start), piece)
            count += int((piece != IGNORE_INDEX).sum())
    want = total / count
    want.backward()
    assert got["losses"][0] == pytest.approx(want.item(), rel=1e-6)
    oracle = {
        "losses": [want.item()],
        "grads": {name: p.grad.numpy() for name, p in model.named_parameters()},
    }
    compare({"losses": got["losses"][:1], "grads": got["grads"]}, oracle, "each document alone")
