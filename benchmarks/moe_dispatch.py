"""Expert parallelism's costs on the CPU, and how far the planner takes Qwen3-30B-A3B on 8 H100.

    PYTHONPATH=. .venv/bin/python benchmarks/moe_dispatch.py [--tokens 8192] [--hidden 1024]
        [--experts 16] [--top-k 2] [--ffn 512] [--world 2] [--repeats 7]
        [--out benchmarks/results/moe_dispatch.json]

- Dispatch: ``--world`` gloo processes (one torch thread each) route ``--tokens`` tokens each
  through a random router (softmax, top-k) and run the trainer's dispatch and combine
  (`parallel.expert_parallel.expert_parallel_dispatch`: the counts exchanged, the rows gathered
  and sent by all-to-all with uneven splits, regrouped by expert, and back, weighted and
  summed) with experts that return their rows; its exchange alone (the counts, then the rows
  each way at the dispatch's own splits); against the ideal, one all-to-all of equal splits
  each way moving the same bytes. Medians of the slowest rank's wall time, interleaved.
- Experts: one process, the trainer's grouped computation (`moe.Experts`: a loop over the
  experts' row blocks on the CPU) over the rows a random router sends to ``--experts`` experts,
  forward and backward, against one dense SwiGLU matmul of the same FLOPs (the rows through one
  expert-sized weight). Medians.
- Reach: the planner's longest sequence for Qwen3-30B-A3B on one node of 8 H100 80 GB at CP 8
  (jobs/qwen3-30b-a3b-extend-256k.yaml, planned routing load 1.5), at each EP degree, without
  offload and with the offload recipe, with the host memory the recipe needs per node.
Prints markdown tables and writes the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ctxlaunch.runtime.modeling.moe import Experts  # noqa: E402

GiB = 1 << 30


def _route(tokens: torch.Tensor, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Top-k experts of a random router's softmax (the trainer's routing, not a uniform draw:
    its load is uneven as a real router's is)."""
    generator = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, tokens.shape[1], generator=generator) * 0.05
    return torch.topk(torch.softmax(tokens @ router.t(), dim=-1), top_k, dim=-1).indices


class _Identity(Experts):
    """Experts that hand their rows back: the dispatch's own cost, no expert compute."""

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return rows


def _dispatch_rank(rank: int, world: int, init: str, args: argparse.Namespace, out: dict) -> None:
    from ctxlaunch.runtime.parallel.expert_parallel import expert_parallel_dispatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randn(args.tokens, args.hidden, generator=generator)
    index = _route(tokens, args.experts, args.top_k, seed=0)
    weights = torch.full(index.shape, 1.0 / args.top_k)
    experts = _Identity(args.experts, args.hidden, 1, swiglu=lambda g, u: g)
    experts.w_gate_up = torch.nn.Parameter(torch.empty(args.experts // world, 2, args.hidden))
    rows = args.tokens * args.top_k
    equal = torch.randn(rows, args.hidden)
    back = torch.empty_like(equal)
    # The dispatch's own splits, for its exchange alone: counts first, then the rows each way.
    counts = torch.bincount(index.reshape(-1), minlength=args.experts)
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts)
    send = counts.view(world, -1).sum(1).tolist()
    receive = arriving.view(world, -1).sum(1).tolist()
    arrived = torch.empty(sum(receive), args.hidden)

    def exchange() -> None:
        dist.all_to_all_single(arriving, counts)
        dist.all_to_all_single(arrived, equal, receive, send)
        dist.all_to_all_single(equal, arrived, send, receive)

    timings: dict[str, list[float]] = {"dispatch": [], "exchange": [], "ideal": []}
    for repeat in range(args.repeats + 1):
        for name in ("dispatch", "exchange", "ideal"):
            dist.barrier()
            start = time.perf_counter()
            if name == "dispatch":
                expert_parallel_dispatch(tokens, index, weights, experts, group=dist.group.WORLD)
            elif name == "exchange":
                exchange()
            else:  # the same rows each way, equal splits, nothing to exchange first
                dist.all_to_all_single(back, equal)
                dist.all_to_all_single(equal, back)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat:  # the first is a warm-up
                timings[name].append(float(elapsed))
    if rank == 0:
        out.update({name: statistics.median(values) for name, values in timings.items()})
    dist.destroy_process_group()


def dispatch_figures(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    out = manager.dict()
    init = tempfile.mktemp(prefix="moe_dispatch_")
    procs = [
        ctx.Process(target=_dispatch_rank, args=(r, args.world, init, args, out))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    if os.path.exists(init):
        os.unlink(init)
    result = dict(out)
    result["ratio"] = result["dispatch"] / result["ideal"]
    result["exchange_ratio"] = result["exchange"] / result["ideal"]
    result["bytes_each_way_per_rank"] = args.tokens * args.top_k * args.hidden * 4
    return result


def experts_figures(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    tokens = torch.randn(args.tokens, args.hidden)
    index = _route(tokens, args.experts, args.top_k, seed=0)
    counts = torch.bincount(index.reshape(-1), minlength=args.experts).tolist()
    rows = tokens[torch.argsort(index.reshape(-1), stable=True) // args.top_k]

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    experts = Experts(args.experts, args.hidden, args.ffn, swiglu)
    for weight in (experts.w_gate_up, experts.w_down):
        torch.nn.init.normal_(weight, std=0.02)
    dense_up = torch.nn.Parameter(torch.randn(2 * args.ffn, args.hidden) * 0.02)
    dense_down = torch.nn.Parameter(torch.randn(args.hidden, args.ffn) * 0.02)

    def grouped() -> None:
        experts(rows.requires_grad_(), counts).sum().backward()

    def dense() -> None:
        gate, up = F.linear(rows.requires_grad_(), dense_up).chunk(2, dim=-1)
        F.linear(swiglu(gate, up), dense_down).sum().backward()

    timings: dict[str, list[float]] = {"grouped": [], "dense": []}
    for repeat in range(args.repeats + 1):
        for name, run in (("grouped", grouped), ("dense", dense)):
            start = time.perf_counter()
            run()
            if repeat:
                timings[name].append(time.perf_counter() - start)
    result = {name: statistics.median(values) for name, values in timings.items()}
    result["ratio"] = result["grouped"] / result["dense"]
    result["busiest_expert_over_mean"] = max(counts) / (sum(counts) / len(counts))
    return result


def reach_figures() -> list[dict]:
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.planning.plan import plan_job

    rows = []
    for ep in (1, 2, 4, 8):
        spec = load_spec(ROOT / "jobs" / "qwen3-30b-a3b-extend-256k.yaml", [f"parallel.ep={ep}"])
        option = next(o for o in plan_job(spec).cp_options if o.dims.cp == 8)
        rows.append(
            {
                "ep": ep,
                "longest_seq_len": option.longest_seq_len,
                "offload_seq_len": option.offload_seq_len,
                "offload_host_gib_per_node": (
                    option.offload_host.per_node / GiB if option.offload_host else None
                ),
                "offload_cp_algorithm": (
                    option.offload_layout.dims.cp_algorithm if option.offload_layout else None
                ),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    figures = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "args": vars(args) | {"out": str(args.out) if args.out else None},
        "dispatch": dispatch_figures(args),
        "experts": experts_figures(args),
        "reach": reach_figures(),
    }
    d, e = figures["dispatch"], figures["experts"]
    print("| measure | ctxlaunch | ideal | ratio |\n|---|---|---|---|")
    print(
        f"| all-to-all exchange (counts, rows each way), {args.world} ranks "
        f"| {d['exchange'] * 1e3:.1f} ms | {d['ideal'] * 1e3:.1f} ms | {d['exchange_ratio']:.2f} |"
    )
    print(
        f"| dispatch + combine, {args.world} ranks, {args.tokens} tokens x top-{args.top_k} each "
        f"| {d['dispatch'] * 1e3:.1f} ms | {d['ideal'] * 1e3:.1f} ms (equal-split all-to-all) "
        f"| {d['ratio']:.2f} |"
    )
    print(
        f"| {args.experts} experts, grouped, fwd+bwd (busiest {e['busiest_expert_over_mean']:.2f}"
        f" x mean) | {e['grouped'] * 1e3:.1f} ms | {e['dense'] * 1e3:.1f} ms (one matmul) "
        f"| {e['ratio']:.2f} |"
    )
    print("\n| ep | longest, no offload | with offload | host GiB/node |\n|---|---|---|---|")
    for row in figures["reach"]:
        host = row["offload_host_gib_per_node"]
        print(
            f"| {row['ep']} | {row['longest_seq_len']:,} | {row['offload_seq_len']:,} | "
            + (f"{host:,.0f}" if host else "")
            + " |"
        )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
