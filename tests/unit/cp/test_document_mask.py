"""Document masks across context parallelism: ring, Ulysses and hybrid attention over packed
sequences equal each document run alone through full causal attention (float64: out, lse,
dq, dk, dv), at CP 2 and 4, zigzag, contiguous and balanced (whose shards are placed per
batch element from its documents); and the computed-area count on hand-worked cases."""

import zlib

import pytest
import torch

from ctxlaunch.cp import (
    attention_area,
    full_attention,
    hybrid_attention,
    new_hybrid_groups,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from tests.helpers.attention import reference_with_grads
from tests.helpers.dist import run_distributed

TOL = dict(rtol=1e-10, atol=1e-10)


def packed_documents(seq_len: int) -> list[tuple[int, ...]]:
    """Three batch elements (the first and last alike, so batch groups are not contiguous) with
    documents of uneven lengths: boundaries inside chunks, on chunk edges, a document shorter
    than a chunk (2 tokens), one spanning several chunks, and one document for the whole."""
    s = seq_len
    return [
        (0, 5, 7, s // 2 - 3, s // 2 + 4, s),
        (0, s // 4, s // 2, s),
        (0, 5, 7, s // 2 - 3, s // 2 + 4, s),
    ]


def per_document_reference(q, k, v, grad, documents):
    """Each document alone through float64 full causal attention: out, lse, (dq, dk, dv)."""
    out, lse = (
        torch.zeros_like(q, dtype=torch.float64),
        torch.zeros(q.shape[:3], dtype=torch.float64),
    )
    grads = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    for b, bounds in enumerate(documents):
        for start, stop in zip(bounds, bounds[1:]):
            piece = [t[b : b + 1, :, start:stop] for t in (q, k, v, grad)]
            o, lse_piece, gs = reference_with_grads(*piece, causal=True)
            out[b : b + 1, :, start:stop], lse[b : b + 1, :, start:stop] = o, lse_piece
            for acc, g in zip(grads, gs):
                acc[b : b + 1, :, start:stop] = g
    return out, lse, grads


def _check(rank, world_size):
    hybrid_groups = new_hybrid_groups(2) if world_size == 4 else None
    worst = {}
    seq_len = 24 * world_size
    documents = packed_documents(seq_len)
    methods = ["ring", "ulysses"] + (["hybrid"] if hybrid_groups else [])
    for method in methods:
        kv_heads = world_size if method == "ulysses" else 2
        for sharding in ("zigzag", "contiguous", "balanced"):
            name = f"{method} N={world_size} {sharding}"
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            q = torch.randn(3, 4, seq_len, 8, generator=g, dtype=torch.float64)
            k, v = (
                torch.randn(3, kv_heads, seq_len, 8, generator=g, dtype=torch.float64)
                for _ in range(2)
            )
            grad = torch.randn(3, 4, seq_len, 8, generator=g, dtype=torch.float64)
            ref_out, ref_lse, ref_grads = per_document_reference(q, k, v, grad, documents)

            def shard(x, sharding=sharding, documents=documents):
                return shard_sequence(x, None, dim=2, sharding=sharding, documents=documents)

            local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
            kwargs = dict(sharding=sharding, return_lse=True, documents=documents)
            if method == "ring":
                out, lse = ring_attention(*local, None, **kwargs)
            elif method == "ulysses":
                out, lse = ulysses_attention(*local, None, **kwargs)
            else:
                out, lse = hybrid_attention(*local, *hybrid_groups, **kwargs)
            out.backward(shard(grad))
            errors = {
                "out": (out.detach() - shard(ref_out)).abs().max(),
                "lse": (lse - shard(ref_lse)).abs().max(),
            }
            for label, t, want in zip("qkv", local, ref_grads):
                errors[f"d{label}"] = (t.grad - shard(want)).abs().max()
            for what, err in errors.items():
                assert err <= 1e-10, f"{name}: {what} differs by {float(err):.3g}"
            worst[name] = max(float(e) for e in errors.values())
            # One document over the whole sequence is the unmasked causal attention (and the
            # balanced sharding of one document is zigzag's).
            whole = [(0, seq_len)] * 3
            single = [shard(t, documents=whole).detach() for t in (q, k, v)]
            if sharding == "balanced":
                zigzag = [shard(t, "zigzag").detach() for t in (q, k, v)]
                assert all(torch.equal(a, b) for a, b in zip(single, zigzag)), name
            if method == "ring":
                plain = ring_attention(*single, None, sharding=sharding)
                one = ring_attention(*single, None, sharding=sharding, documents=whole)
            elif method == "ulysses":
                plain = ulysses_attention(*single, None, sharding=sharding)
                one = ulysses_attention(*single, None, sharding=sharding, documents=whole)
            else:
                plain = hybrid_attention(*single, *hybrid_groups, sharding=sharding)
                one = hybrid_attention(*single, *hybrid_groups, sharding=sharding, documents=whole)
            torch.testing.assert_close(one, plain, **TOL)
    return worst


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_document_mask_matches_each_document_alone(world_size):
    worst = run_distributed(_check, world_size, timeout_s=170)
    print({k: f"{v:.2e}" for k, v in worst[0].items()})


def test_full_attention_with_documents_and_errors():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 48, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(3, 2, 48, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    grad = torch.randn(3, 4, 48, 8, generator=g, dtype=torch.float64)
    documents = packed_documents(48)
    out, lse = full_attention(q, k, v, return_lse=True, documents=documents)
    out.backward(grad)
    ref_out, ref_lse, ref_grads = per_document_reference(
        q.detach(), k.detach(), v.detach(), grad, documents
    )
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    for t, want in zip((q, k, v), ref_grads):
        torch.testing.assert_close(t.grad, want, **TOL)
    with pytest.raises(ValueError, match="must run from 0 to the sequence length 48"):
        full_attention(q, k, v, documents=[(0, 40)] * 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        full_attention(q, k, v, documents=[(0, 9, 9, 48)] * 3)
    with pytest.raises(ValueError, match="3 boundary lists for a batch of 3|2 boundary lists"):
        full_attention(q, k, v, documents=[(0, 48)] * 2)
    with pytest.raises(ValueError, match="needs causal=True"):
        full_attention(q, k, v, causal=False, documents=[(0, 48)] * 3)


def test_attention_area_hand_worked():
    # S = 16, N = 2, zigzag: chunks of 4; rank 0 holds chunks 0 and 3 ([0,4) + [12,16)), rank 1
    # chunks 1 and 2 ([4,12)). Documents [0,3), [3,10), [10,16).
    area = attention_area([(0, 3, 10, 16)], 16, 2, "zigzag")
    # Each document's causal triangle: 3*4/2 + 7*8/2 + 6*7/2 = 6 + 28 + 21.
    assert area.computed == 55 and area.unmasked == 16 * 17 // 2 == 136
    # Rank 0: diagonal chunk 0: doc 0 rows 0-2 (6) + doc 1 row 3 (1); diagonal chunk 3: doc 2 rows
    # 12-15 (10); chunk 3 over chunk 0: no shared document; over rank 1's chunk 1: none; over
    # chunk 2: doc 2's rows 12-15 x keys 10-11 (8). 7 + 10 + 8 = 25.
    # Rank 1: diagonal chunk 1: doc 1 rows 4-7 (10); diagonal chunk 2: doc 1 rows 8-9 (3) + doc 2
    # rows 10-11 (3); chunk 2 over chunk 1: doc 1 rows 8-9 x keys 4-7 (8); over rank 0's chunk 0:
    # doc 1 rows 4-9 x key 3 (6). 10 + 6 + 8 + 6 = 30.
    assert area.per_rank_computed == (25, 30)
    assert area.per_rank_unmasked == (68, 68)
    assert area.computed_fraction == pytest.approx(55 / 136)
    assert area.critical_fraction == pytest.approx(30 / 68)
    # Contiguous, two documents on the shard boundary: rank 1's block of rank 0 is skipped.
    area = attention_area([(0, 8, 16)], 16, 2, "contiguous")
    assert (area.computed, area.blocks_computed, area.blocks_skipped) == (72, 2, 1)
    assert area.per_rank_computed == (36, 36) and area.per_rank_unmasked == (36, 100)
    # One document: nothing is skipped, at any sharding.
    for sharding in ("zigzag", "contiguous"):
        area = attention_area([(0, 64)] * 2, 64, 4, sharding)
        assert area.computed == area.unmasked and area.blocks_skipped == 0
