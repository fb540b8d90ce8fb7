"""Ring, Ulysses and hybrid attention against a float64 full-sequence reference: out, lse and
dq/dk/dv, causal and not, both shardings, GQA, a scale, fp32 and bf16 (gloo worker processes)."""

import itertools
import zlib

import pytest
import torch
import torch.distributed as dist

from ctxlaunch.cp import (
    full_attention,
    hybrid_attention,
    new_hybrid_groups,
    ring_attention,
    shard_sequence,
    simulated_link_delay,
    ulysses_attention,
    unshard_sequence,
)
from tests.helpers.attention import reference_with_grads
from tests.helpers.dist import run_distributed

# (out and gradients, lse) tolerances against the float64 reference on the same inputs. bf16:
# out and gradients are rounded to bf16 (8-bit mantissa) and the kernel's bf16 backward works
# at that precision; lse is fp32 whatever the input dtype.
TOLERANCES = {
    torch.float32: (dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-5, atol=1e-5)),
    torch.bfloat16: (dict(rtol=2e-2, atol=2e-2), dict(rtol=1e-3, atol=1e-3)),
}


def _cases(world_size, method):
    """(name, B, Hq, Hkv, S, D, causal, sharding, dtype, scale) for one world size and method."""
    kv_heads = world_size if method == "ulysses" else 2
    shapes = [
        (1, 4, 4, None, torch.float32),
        (2, 8, kv_heads, 0.3, torch.float32),
        (1, 8, kv_heads, None, torch.bfloat16),
    ]
    for (b, hq, hkv, scale, dtype), causal, sharding in itertools.product(
        shapes, [True, False], ["zigzag", "contiguous"]
    ):
        seq_len = 16 * world_size
        name = (
            f"{method} N={world_size} B={b} Hq={hq} Hkv={hkv} S={seq_len} causal={causal} "
            f"{sharding} {dtype} scale={scale}"
        )
        yield name, b, hq, hkv, seq_len, 16, causal, sharding, dtype, scale


def _check_method(rank, world_size, method):
    if method == "hybrid":
        ulysses_group, ring_group = new_hybrid_groups(2)
    for name, b, hq, hkv, seq_len, d, causal, sharding, dtype, scale in _cases(world_size, method):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # same inputs on every rank
        q = torch.randn(b, hq, seq_len, d, generator=g).to(dtype)
        k, v = (torch.randn(b, hkv, seq_len, d, generator=g).to(dtype) for _ in range(2))
        grad = torch.randn(b, hq, seq_len, d, generator=g).to(dtype)
        ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, grad, causal, scale)

        def shard(x):
            return shard_sequence(x, None, dim=2, sharding=sharding)

        local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
        kwargs = dict(causal=causal, sharding=sharding, scale=scale, return_lse=True)
        if method == "ring":
            out, lse = ring_attention(*local, None, **kwargs)
        elif method == "ulysses":
            out, lse = ulysses_attention(*local, None, **kwargs)
        else:
            out, lse = hybrid_attention(*local, ulysses_group, ring_group, **kwargs)
        out.backward(shard(grad))

        tol, lse_tol = TOLERANCES[dtype]
        assert out.dtype == dtype and lse.dtype == torch.float32, name
        _assert_close(out, shard(ref_out), tol, f"{name}: out")
        _assert_close(lse, shard(ref_lse), lse_tol, f"{name}: lse")
        for label, t, want in zip("qkv", local, ref_grads):
            assert t.grad.dtype == dtype, name
            _assert_close(t.grad, shard(want), tol, f"{name}: d{label}")
        if dtype == torch.bfloat16:
            # CP must not be much less accurate than the same kernel over the whole sequence.
            single_err = (
                (full_attention(q, k, v, causal=causal, scale=scale).double() - ref_out).abs().max()
            )
            cp_err = (out.double() - shard(ref_out)).abs().max()
            assert cp_err <= 2 * single_err + 1e-3, (
                f"{name}: bf16 error {cp_err} vs single-process {single_err}"
            )


def _assert_close(got, want, tol, what):
    torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{what}\n{m}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_matches_reference(world_size):
    run_distributed(_check_method, world_size, "ring")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_matches_reference(world_size):
    run_distributed(_check_method, world_size, "ulysses")


@pytest.mark.timeout(180)
def test_hybrid_2x2_matches_reference():
    run_distributed(_check_method, 4, "hybrid")


def _check_groups_and_errors(rank, world_size):
    # unshard_sequence gathers what shard_sequence cut, for both shardings.
    x = torch.arange(2 * 3 * 32, dtype=torch.float32).view(2, 3, 32)
    for sharding in ("zigzag", "contiguous"):
        torch.testing.assert_close(
            unshard_sequence(shard_sequence(x, None, 2, sharding), None, 2, sharding), x
        )
    # A group that is not the default one: the ring runs on global ranks through it.
    ulysses_group, ring_group = new_hybrid_groups(2)
    assert dist.get_world_size(ring_group) == 2 and dist.get_world_size(ulysses_group) == 2
    q = torch.randn(1, 8, 8, 16)
    k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError) as err:
        ulysses_attention(q, k, v, None)
    message = str(err.value)
    assert (
        "key/value heads (2)" in message and "Ulysses degree (4)" in message and "hybrid" in message
    )
    with pytest.raises(
        ValueError, match=r"query heads \(6\) must be divisible by the Ulysses degree \(4\)"
    ):
        ulysses_attention(
            torch.randn(1, 6, 8, 16), torch.randn(1, 6, 8, 16), torch.randn(1, 6, 8, 16), None
        )
    with pytest.raises(ValueError, match="sequence length 12 cannot be sharded over N=4"):
        ring_attention(
            torch.randn(1, 4, 3, 16), torch.randn(1, 4, 3, 16), torch.randn(1, 4, 3, 16), None
        )
    with pytest.raises(ValueError, match="same length, got 8 and 4"):
        ring_attention(q, torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), None)
    with pytest.raises(ValueError, match="sharding='stripe' is not supported"):
        hybrid_attention(q, k, v, ulysses_group, ring_group, sharding="stripe")
    # The same GQA shape that Ulysses rejects at degree 4 runs as 2 (Ulysses) x 2 (ring).
    hybrid_attention(q, k, v, ulysses_group, ring_group)
    # DP x CP: two CP groups of 2 ({0, 1} and {2, 3}); each builds its own hybrid groups (a ring of
    # 2 with U=1) and computes its own attention, against the full reference.
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_group = cp_groups[rank // 2]
    ulysses_1, ring_2 = new_hybrid_groups(1, cp_group)
    g = torch.Generator().manual_seed(100 + rank // 2)
    q4, k4, v4 = (torch.randn(1, 4, 32, 16, generator=g) for _ in range(3))
    ref_out, _, ref_grads = reference_with_grads(q4, k4, v4, torch.ones(1, 4, 32, 16), causal=True)
    local = [shard_sequence(t, cp_group).clone().requires_grad_() for t in (q4, k4, v4)]
    out = hybrid_attention(*local, ulysses_1, ring_2)
    out.sum().backward()
    torch.testing.assert_close(
        out.double(), shard_sequence(ref_out, cp_group), rtol=1e-5, atol=1e-5
    )
    for t, want in zip(local, ref_grads):
        torch.testing.assert_close(
            t.grad.double(), shard_sequence(want, cp_group), rtol=1e-5, atol=1e-5
        )
    # A simulated slow link (the overlap benchmark's hook) delays transfers, never changes them.
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    ring_attention(*local, None).sum().backward()
    slow = [t.clone().requires_grad_() for t in (q, k, v)]
    with simulated_link_delay(0.01):
        ring_attention(*slow, None).sum().backward()
    for fast_t, slow_t in zip(local, slow):
        torch.testing.assert_close(slow_t.grad, fast_t.grad, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_groups_unshard_and_errors():
    run_distributed(_check_groups_and_errors, 4)


def _check_tiles(rank, world_size):
    """Tiled backward against one call per block: the same out, lse and gradients. A masked
    block the tiles cut runs as its rectangles even where FlexAttention is asked for."""
    from ctxlaunch.cp import kernels

    ulysses_group, ring_group = new_hybrid_groups(2)
    seq_len = 24 * world_size
    documents = [[0, 7, 40, seq_len]]
    cases = [
        (method, causal, sharding, docs, tile, "auto")
        for method in ("ring", "hybrid")
        for causal, sharding, docs in (
            (True, "zigzag", None),
            (False, "zigzag", None),
            (True, "contiguous", None),
            (True, "zigzag", documents),
        )
        for tile in (5, 16)
    ] + [("ring", True, "zigzag", documents, 5, "flex")]
    for method, causal, sharding, documents, tile, masked in cases:
        kernels.use_masked_kernel(masked)
        name = f"{method} causal={causal} {sharding} documents={documents} tile={tile} {masked}"
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        q = torch.randn(1, 4, seq_len, 8, generator=g)
        k, v = (torch.randn(1, 2, seq_len, 8, generator=g) for _ in range(2))
        grad = torch.randn(1, 4, seq_len, 8, generator=g)

        def run(tile_tokens):
            local = [
                shard_sequence(t, None, dim=2, sharding=sharding).clone().requires_grad_()
                for t in (q, k, v)
            ]
            kwargs = dict(causal=causal, sharding=sharding, return_lse=True, documents=documents)
            if method == "ring":
                out, lse = ring_attention(*local, None, tile_tokens=tile_tokens, **kwargs)
            else:
                out, lse = hybrid_attention(
                    *local, ulysses_group, ring_group, tile_tokens=tile_tokens, **kwargs
                )
            out.backward(shard_sequence(grad, None, dim=2, sharding=sharding))
            return [out, lse] + [t.grad for t in local]

        for label, got, want in zip(["out", "lse", "dq", "dk", "dv"], run(tile), run(None)):
            torch.testing.assert_close(
                got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {label}\n{m}"
            )
    kernels.use_masked_kernel("auto")


@pytest.mark.timeout(180)
def test_tiled_backward_matches_untiled():
    run_distributed(_check_tiles, 4)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tile", [1, 3, 4, 7, 50])
def test_tiles_cover_the_piece_once(causal, tile):
    """The tiles of a piece cover exactly its visible (query, key) pairs, each once."""
    from ctxlaunch.cp.ring import _tiles

    n = 13
    piece = (slice(2, 2 + n), slice(5, 5 + n), causal)
    cover = torch.zeros(20, 20, dtype=torch.int64)
    for rows, keys, tile_causal in _tiles(piece, 20, 20, tile):
        block = torch.ones(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.int64)
        if tile_causal:
            assert block.size(0) == block.size(1)
            block = block.tril()
        cover[rows, keys] += block
    want = torch.zeros(20, 20, dtype=torch.int64)
    want[2 : 2 + n, 5 : 5 + n] = torch.ones(n, n, dtype=torch.int64).tril() if causal else 1
    assert torch.equal(cover, want)
