"""Local (sliding-window) attention, soft-capped scores and attention sinks, at one process and
under CP (ring with its three shardings, Ulysses, hybrid), against the float64 math reference
(tests/helpers/attention.py): out, lse, dq/dk/dv and the sinks' gradient. The plan's pieces
cover every visible (query, key) pair exactly once and nothing else; the halo exchange moves
only the window's rows, one send per chunk when the window fits in the preceding chunk.

A tiny decoder with sinks (GPT-OSS's part, ahead of its family) trains at CP 2 as at one
process. The multi-process cases run in one launch per world size (gloo processes)."""

from __future__ import annotations

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
    ulysses_attention,
)
from ctxlaunch.cp.comm import commit_sizes, exchange_sizes
from ctxlaunch.cp.documents import RingShards
from ctxlaunch.cp.window import block_plan, halo_plan_bytes
from tests.helpers.attention import reference_with_grads
from tests.helpers.dist import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(name: str, b: int, hq: int, hkv: int, s: int, d: int, sinks: bool):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same on every rank
    q = torch.randn(b, hq, s, d, generator=g)
    k, v = (torch.randn(b, hkv, s, d, generator=g) for _ in range(2))
    grad = torch.randn(b, hq, s, d, generator=g)
    return q, k, v, grad, (torch.randn(hq, generator=g) if sinks else None)


def _assert_close(got, want, what):
    torch.testing.assert_close(got.double(), want, **TOL, msg=lambda m: f"{what}\n{m}")


# -- one process ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "window, softcap, sinks, documents",
    [
        (1, None, False, None),
        (5, None, False, None),
        (16, 2.0, False, None),
        (300, None, True, None),  # longer than the sequence: full causal
        (7, 3.0, True, [[0, 10, 37], [0, 37]]),
        (None, 3.0, False, [[0, 20, 37], [0, 5, 37]]),
        (None, None, True, None),
    ],
)
def test_one_process_matches_the_reference(window, softcap, sinks, documents) -> None:
    """Every combination at one process (GQA, a scale, two sequences, a length no tile divides)
    is the reference's out, lse and gradients, the sinks' included."""
    name = f"one {window} {softcap} {sinks} {documents}"
    q, k, v, grad, sink = _inputs(name, 2, 4, 2, 37, 16, sinks)
    extended = dict(window=window, softcap=softcap, documents=documents)
    ref_out, ref_lse, ref_grads = reference_with_grads(
        q, k, v, grad, True, 0.3, sinks=sink, **extended
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_() if sink is not None else None
    out, lse = full_attention(
        *leaves, True, 0.3, True, documents, window=window, softcap=softcap, sinks=sink_leaf
    )
    out.backward(grad)
    _assert_close(out, ref_out, "out")
    _assert_close(lse, ref_lse, "lse")
    for label, leaf, want in zip(("q", "k", "v", "sinks"), [*leaves, sink_leaf], ref_grads):
        _assert_close(leaf.grad, want, f"d{label}")


def test_extensions_need_causal_and_sane_values() -> None:
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="need causal=True"):
        full_attention(q, q, q, causal=False, window=4)
    with pytest.raises(ValueError, match="window must be None or a positive integer"):
        full_attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="softcap must be None or a positive number"):
        full_attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match=r"one logit per query head \(2,\)"):
        full_attention(q, q, q, sinks=torch.zeros(3))


# -- the plan ------------------------------------------------------------------------------------
def _covered(seq_len, shards, documents, window) -> torch.Tensor:
    """How many times the calls of every block of every ring rank compute each visible (query,
    key) pair of a batch element, as an (S, S) count in global positions."""
    counts = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    bounds = documents[0] if documents is not None else (0, seq_len)
    positions = [
        [start + i for _, start, length in shards.runs(bounds, r) for i in range(length)]
        for r in range(shards.ring_size)
    ]
    for rank, src in itertools.product(range(shards.ring_size), repeat=2):
        plan = block_plan(documents, seq_len, shards, rank, src, window)
        keys = positions[src]
        if src != rank:  # the calls index the halo: the source's rows in halo order
            keys = [keys[row] for start, stop in plan.halo for row in range(start, stop)]
        for _, calls in plan.calls:
            for rows, kv_rows, kind, offset in calls:
                n, m = rows.stop - rows.start, kv_rows.stop - kv_rows.start
                a, b = torch.arange(n)[:, None], torch.arange(m)[None, :]
                seen = torch.ones(n, m, dtype=torch.bool)
                if kind == "causal":
                    seen = b <= a
                elif kind == "band":
                    seen = (offset + a - b >= 0) & (offset + a - b < (window or seq_len))
                # Every row of a call sees a key (a kernel gives an empty row lse 0, not -inf).
                assert bool(seen.any(dim=1).all()), (rank, src, rows, kv_rows, kind)
                q_pos = torch.tensor(positions[rank][rows])
                k_pos = torch.tensor(keys[kv_rows])
                qi, kj = torch.meshgrid(q_pos, k_pos, indexing="ij")
                counts.index_put_(
                    (qi[seen], kj[seen]),
                    torch.ones(int(seen.sum()), dtype=torch.int64),
                    accumulate=True,
                )
    return counts


@pytest.mark.parametrize(
    "sharding, ring, ulysses, window, documents",
    [
        ("zigzag", 4, 1, 5, None),
        ("zigzag", 4, 1, 16, None),
        ("zigzag", 4, 1, 40, None),
        ("contiguous", 3, 1, 21, None),
        ("balanced", 4, 1, 9, ((0, 3, 50, 64),)),
        ("zigzag", 2, 2, 11, ((0, 30, 64),)),
        ("zigzag", 4, 1, None, ((0, 17, 64),)),
    ],
)
def test_the_calls_cover_each_visible_pair_once(sharding, ring, ulysses, window, documents):
    """Over every block of every ring rank, each visible pair is computed exactly once and no
    hidden pair is, for every sharding, a hybrid's ring, documents and windows below, at and
    above a chunk."""
    seq_len = 64 if sharding != "contiguous" else 63
    shards = RingShards(sharding, ring, ulysses)
    counts = _covered(seq_len, shards, documents, window)
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    visible = (j <= i) & ((i - j) < (window or seq_len))
    if documents is not None:
        doc = torch.bucketize(torch.arange(seq_len), torch.tensor(documents[0][1:]), right=True)
        visible &= doc[:, None] == doc[None, :]
    assert torch.equal(counts, visible.long())


def test_a_window_within_a_chunk_needs_one_neighbour_per_chunk() -> None:
    """128 tokens over a zigzag ring of 4 (chunks of 16) with a window of 9: each chunk needs the
    last 8 rows of the chunk before it, from the rank holding it (none for chunk 0, and rank
    3's second chunk follows its first); every other block is skipped, no bytes, no call."""
    shards = RingShards("zigzag", 4)
    owner = {c: r for r in range(4) for c in (r, 7 - r)}
    for rank in range(4):
        needs = {}
        for src in range(4):
            plan = block_plan(None, 128, shards, rank, src, 9)
            if src != rank and plan.halo:
                needs[src] = plan.halo
            if src != rank and not plan.halo:
                assert plan.calls == ((slice(None), ()),), (rank, src)
        want = {}
        for chunk in (rank, 7 - rank):
            if chunk > 0 and owner[chunk - 1] != rank:
                src = owner[chunk - 1]
                local = 0 if chunk - 1 == src else 16  # its first or second chunk
                want[src] = ((local + 8, local + 16),)
        assert needs == want, rank
    # In bytes: 8 rows of K and V per needing chunk, against 3 hops of whole shards.
    row = 2 * 4 * 16  # 2 K/V heads of 16 fp32
    assert halo_plan_bytes(None, 128, shards, 9, row) == [2 * 8 * row * n for n in (1, 2, 2, 1)]


# -- under CP ----------------------------------------------------------------------------------
def _cases(world_size: int):
    """(method, sharding, documents, window, softcap, sinks) of one launch. At 16 tokens a rank
    (zigzag chunks of 8): windows below a chunk, of a whole shard, and spanning two shards.
    The ones marked "flex" run each block as one FlexAttention call (the CUDA path, run here on
    torch's dense reference implementation)."""
    seq_len = 16 * world_size
    docs = [[0, 5, seq_len - 7, seq_len], [0, seq_len // 2 + 1, seq_len]]
    cases = []
    for window in (5, 16, 24):
        cases += [
            ("ring", "zigzag", None, window, None, window == 16),
            ("ring", "contiguous", None, window, 2.0, False),
            ("ring", "balanced", docs, window, None, window == 24),
        ]
    cases += [("ring", "zigzag", docs, None, 2.0, True)]  # a soft-capped global layer with sinks
    cases += [
        ("ring", "zigzag", None, 5, None, True, "flex"),
        ("ring", "balanced", docs, 24, None, False, "flex"),
    ]
    if world_size == 2:
        cases += [
            ("ulysses", "zigzag", None, 5, 2.0, True),
            ("ulysses", "balanced", docs, 24, None, False),
        ]
    else:
        cases += [
            ("hybrid", "zigzag", None, 5, None, True),
            ("hybrid", "contiguous", docs, 24, 2.0, False),
        ]
    return cases


def _check_cp(rank, world_size):
    groups = new_hybrid_groups(2) if world_size == 4 else None
    seq_len = 16 * world_size
    from ctxlaunch.cp import kernels

    for method, sharding, documents, window, softcap, with_sinks, *kernel in _cases(world_size):
        name = (
            f"{method} {sharding} documents={documents} window={window} softcap={softcap} "
            f"sinks={with_sinks} {kernel}"
        )
        kernels.use_masked_kernel(kernel[0] if kernel else "auto")
        kv_heads = world_size if method == "ulysses" else 2
        q, k, v, grad, sinks = _inputs(name, 2, 4, kv_heads, seq_len, 8, with_sinks)
        extended = dict(window=window, softcap=softcap, documents=documents)
        ref_out, ref_lse, ref_grads = reference_with_grads(
            q, k, v, grad, True, 0.3, sinks=sinks, **extended
        )

        def shard(x, sharding=sharding, documents=documents):
            return shard_sequence(x, None, 2, sharding, documents)

        leaves = [shard(t).clone().requires_grad_() for t in (q, k, v)]
        sink_leaf = sinks.clone().requires_grad_() if sinks is not None else None
        kwargs = dict(
            causal=True, sharding=sharding, scale=0.3, return_lse=True, sinks=sink_leaf, **extended
        )
        if method == "ring":
            out, lse = ring_attention(*leaves, None, **kwargs)
        elif method == "ulysses":
            out, lse = ulysses_attention(*leaves, None, **kwargs)
        else:
            out, lse = hybrid_attention(*leaves, *groups, **kwargs)
        out.backward(shard(grad))
        _assert_close(out, shard(ref_out), f"{name}: out")
        _assert_close(lse, shard(ref_lse), f"{name}: lse")
        for label, leaf, want in zip("qkv", leaves, ref_grads):
            _assert_close(leaf.grad, shard(want), f"{name}: d{label}")
        if sink_leaf is not None:
            # Each rank's share of the sinks' gradient comes from its rows: summed over CP, as
            # the trainer's gradient reduction does, it is the whole.
            total = sink_leaf.grad.clone()
            dist.all_reduce(total)
            _assert_close(total, ref_grads[3], f"{name}: dsinks")
    kernels.use_masked_kernel("auto")
    if world_size == 4:
        _check_exchanges(rank)
    else:
        _check_model_with_sinks(rank, world_size)
    return True


def _check_model_with_sinks(rank, world_size):
    """A tiny decoder whose attention has sinks (GPT-OSS's part; no family here has it yet),
    a local and a full layer: its loss and every gradient, the sinks' included, at CP 2 (ring
    and Ulysses, zigzag) are one process's."""
    import copy
    from functools import partial

    from ctxlaunch.cp import shard_positions
    from ctxlaunch.runtime.modeling.model import Transformer

    torch.manual_seed(0)
    model = Transformer(
        layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=64, rope_theta=1e4,
        norm_eps=1e-5, tie_embeddings=False, attention_sinks=True, layer_windows=(9, None),
    )  # fmt: skip
    model.init_weights(3)
    with torch.no_grad():
        for block in model.block_modules():
            block.attn.sinks.normal_()
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(5))
    targets = tokens.roll(-1, dims=1)
    reference = copy.deepcopy(model)
    reference.loss_divisor = targets.numel()
    want_loss = reference(tokens, torch.arange(32), targets)
    want_loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    assert float(want["blocks.0.attn.sinks"].abs().max()) > 0
    for attention in (ring_attention, ulysses_attention):
        cp = copy.deepcopy(model)
        cp.loss_divisor = targets.numel()  # the global count: the ranks' losses sum to the mean
        for block in cp.block_modules():
            block.attn.attend = partial(attention, group=None, causal=True, sharding="zigzag")
        loss = cp(
            shard_sequence(tokens, None, 1),
            shard_positions(32, rank, world_size),
            shard_sequence(targets, None, 1),
        )
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, want_loss.detach())
        for name, param in cp.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(
                grad, want[name], rtol=1e-4, atol=1e-6,
                msg=lambda m, n=name, a=attention.__name__: f"{a}: gradient of {n}: {m}",
            )  # fmt: skip


def _check_exchanges(rank):
    """A local layer at CP 4 zigzag with a window inside a chunk: one forward commit with one
    send per chunk that needs a neighbour's rows (8 rows of K and V: 2 x 8 x 2 heads x 8 x 4
    bytes), one backward commit sending their fp32 gradients home; never CP - 1 hops."""
    x = torch.randn(1, 4, 16, 8)
    k = v = torch.randn(1, 2, 16, 8)
    before_sends, before_commits = exchange_sizes(), commit_sizes()
    leaves = [t.clone().requires_grad_() for t in (x, k, v)]
    ring_attention(*leaves, None, window=9).sum().backward()
    sends = {n: c - before_sends.get(n, 0) for n, c in exchange_sizes().items()}
    commits = {n: c - before_commits.get(n, 0) for n, c in commit_sizes().items()}
    sends = {n: c for n, c in sends.items() if c}
    chunks_needing = {0: 1, 1: 2, 2: 2, 3: 1}[rank]  # those whose predecessor is elsewhere
    halo = 2 * 8 * 2 * 8 * 4
    assert sends == {halo: 2 * chunks_needing}, (rank, sends)
    assert sum(commits.values()) == 2, (rank, commits)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_layouts_match_the_reference(world_size):
    run_distributed(_check_cp, world_size, timeout_s=280)
