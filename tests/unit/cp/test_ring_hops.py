"""What one ring hop costs, read from torch's own records on the CPU: the profiler's per-op
memory accounting shows that after the first hop the ring allocates nothing but what the
attention kernels return (every send/receive buffer, accumulator and merge scratch exists
before the loop), and the ring's commit log shows each hop sends exactly the formula's bytes.

Three gloo processes (a ring of 3 is the smallest in which the buffers take turns)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ctxlaunch.cp import ring_attention
from ctxlaunch.cp.comm import commit_sizes
from tests.helpers.dist import run_distributed

B, HQ, HKV, S_LOCAL, D = 1, 4, 2, 16, 16
CASES = [  # (sharding, causal, documents of the whole 3 x 16-token sequence)
    ("zigzag", True, None),
    ("contiguous", False, None),
    ("zigzag", True, [[0, 5, 30, 48]]),
]


def _allocations_by_hop(prof) -> dict[tuple[str | None, bool], list[tuple[str, int]]]:
    """Every op that allocated (its own bytes, children excluded), keyed by the ring step range
    (``cp.ring.forward.step1``; None outside the loop) and whether it ran inside a kernel call."""
    found: dict[tuple[str | None, bool], list[tuple[str, int]]] = {}
    for event in prof.events():
        if event.self_cpu_memory_usage <= 0:
            continue
        chain, parent = [], event
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        hop = next((name for name in chain if name.startswith("cp.ring.")), None)
        in_kernel = any("scaled_dot_product_flash_attention" in name for name in chain)
        found.setdefault((hop, in_kernel), []).append((event.name, event.self_cpu_memory_usage))
    return found


def _check_hops(rank, world_size):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, HQ, S_LOCAL, D, generator=g).requires_grad_()
    k, v = (torch.randn(B, HKV, S_LOCAL, D, generator=g).requires_grad_() for _ in range(2))
    kv_bytes = B * HKV * S_LOCAL * D * 4  # one fp32 K (or V) shard
    for sharding, causal, documents in CASES:
        name = f"{sharding} causal={causal} documents={documents}"
        ring_attention(
            q, k, v, causal=causal, sharding=sharding, documents=documents
        ).sum().backward()
        before = commit_sizes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = ring_attention(q, k, v, causal=causal, sharding=sharding, documents=documents)
            out.backward(torch.ones_like(out))
        sent = {
            size: n - before.get(size, 0)
            for size, n in commit_sizes().items()
            if n != before.get(size, 0)
        }
        # Forward: N-1 hops of K and V. Backward: N-1 hops of K and V, and N-1 of the fp32 dK/dV
        # accumulators (the same sizes here, fp32 inputs): 3 (N-1) commits of 2 shards each.
        assert sent == {2 * kv_bytes: 3 * (world_size - 1)}, (name, sent)
        found = _allocations_by_hop(prof)
        hops = {hop for hop, _ in found if hop is not None}
        for direction in ("forward", "backward"):
            for step in range(1, world_size):
                hop = f"cp.ring.{direction}.step{step}"
                outside = found.get((hop, False), [])
                assert outside == [], f"{name}: {hop} allocated outside the kernels: {outside}"
        # The profiler saw the hops (the check above is not vacuous): each forward step but the
        # first computes and its kernels return fresh outputs.
        for step in range(1, world_size):
            assert (f"cp.ring.forward.step{step}", True) in found or documents, (name, sorted(hops))
        assert ("cp.ring.forward.step0", True) in found, (name, sorted(hops))
    return True


@pytest.mark.timeout(400)
def test_ring_hops_allocate_nothing_and_send_the_formula():
    run_distributed(_check_hops, 3, timeout_s=360)
