"""The balanced CP sharding against zigzag and contiguous under a document mask (CPU/gloo).

    PYTHONPATH=. .venv/bin/python benchmarks/cp_balance.py [--seq 131072] [--sequences 16]
        [--time-seq 16384] [--time-cp 2 4] [--out benchmarks/results/cp_balance.json]

Areas: for every long-tailed length distribution of devkit/doc_lengths.py, and for a
real tokenized corpus (every .py file of this Python's standard library, one document each,
tokenized with Llama 3's tiktoken BPE from the llama_models package, in a seeded shuffle;
packed into
``--sequences`` sequences of ``--seq`` tokens at fixed offsets, as the trainer packs) and every
worst case of a fixed sharding, the busiest ring rank's attention area over the mean
(``attention_area``, the schedule's own count) at CP 2, 4, 8 and 16, for each sharding: the
worst and the mean over the sequences. Time: ``--time-cp`` gloo processes (one torch thread
each) run document-masked ring attention forward+backward on one packed sequence of
``--time-seq`` tokens (the first of ``--time-lengths`` with ``--time-seed``; the area table
packs seed 1), under each sharding, and unmasked
zigzag at the same tokens, interleaved: medians of the slowest rank's wall time and of each
rank's thread CPU time (what the rank computed; sharing cores does not inflate it). Prints
markdown tables and writes the raw figures as JSON.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ctxlaunch.cp import attention_area, ring_attention, shard_sequence  # noqa: E402
from devkit.doc_lengths import LONG_TAILED, lengths, pack, worst_cases  # noqa: E402

SHARDINGS = ("balanced", "zigzag", "contiguous")
CP_SIZES = (2, 4, 8, 16)


REAL_CORPUS = "CPython stdlib .py files, Llama 3 tokens"


def real_corpus_lengths() -> list[int]:
    """Token counts of the standard library's .py files (one document each), seeded shuffle."""
    import random
    import sysconfig
    from importlib.metadata import distribution

    from ctxlaunch.runtime.data.tokenizers import load_tokenizer

    member = "llama_models/llama3/tokenizer.model"
    tokenizer = load_tokenizer(Path(str(distribution("llama_models").locate_file(member))))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    counts = [
        len(tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))) + 1 for f in files
    ]
    random.Random(0).shuffle(counts)
    return [c for c in counts if c > 0]


def _cycle(values: list[int]):
    while True:
        yield from values


def area_table(seq_len: int, sequences: int, corpus: list[int]) -> list[dict]:
    """One row per (distribution, CP, sharding): worst and mean busiest/mean over sequences."""
    rows = []
    cases: dict[str, list[tuple[int, ...]]] = {
        name: pack(lengths(sampler, seed=1), seq_len, sequences)
        for name, sampler in LONG_TAILED.items()
    }
    cases[REAL_CORPUS] = pack(_cycle(corpus), seq_len, sequences)
    for world_size in CP_SIZES:
        for name, bounds in worst_cases(seq_len, world_size).items():
            cases.setdefault(f"worst case: {name}", []).append(bounds)
    for name, packed in cases.items():
        for world_size in CP_SIZES:
            worst = worst_cases(seq_len, world_size)
            chosen = (
                [worst[name.removeprefix("worst case: ")]]
                if name.startswith("worst case: ")
                else packed
            )
            for sharding in SHARDINGS:
                ratios = [
                    attention_area([b], seq_len, world_size, sharding).busiest_over_mean
                    for b in chosen
                ]
                rows.append(
                    {
                        "distribution": name,
                        "cp": world_size,
                        "sharding": sharding,
                        "sequences": len(chosen),
                        "documents_per_sequence": statistics.mean(len(b) - 1 for b in chosen),
                        "worst_busiest_over_mean": max(ratios),
                        "mean_busiest_over_mean": statistics.mean(ratios),
                    }
                )
    return rows


def _worker(rank, world_size, init_file, args, bounds, results):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    documents = [bounds]
    g = torch.Generator().manual_seed(0)
    seq_len = args.time_seq
    full = [torch.randn(1, args.heads, seq_len, args.head_dim, generator=g) for _ in range(4)]
    variants = {}
    for sharding, masked in [(s, True) for s in SHARDINGS] + [("zigzag", False)]:
        shards = [shard_sequence(t, None, 2, sharding, documents) for t in full]
        variants[(sharding, masked)] = (shards, sharding, documents if masked else None)
    walls: dict = {name: [] for name in variants}
    cpus: dict = {name: [] for name in variants}
    for _ in range(args.reps + 1):
        for name, (shards, sharding, docs) in variants.items():
            q, k, v = (t.detach().requires_grad_() for t in shards[:3])
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.thread_time()
            ring_attention(q, k, v, None, sharding=sharding, documents=docs).backward(shards[3])
            cpus[name].append(time.thread_time() - cpu_start)
            dist.barrier()
            walls[name].append(time.perf_counter() - start)
    results.put(
        (
            rank,
            {
                name: (statistics.median(walls[name][1:]), statistics.median(cpus[name][1:]))
                for name in variants
            },
        )
    )
    dist.destroy_process_group()


def time_table(args) -> list[dict]:
    """Slowest rank's median ring fwd+bwd per sharding at each CP size of ``--time-cp``."""
    bounds = pack(lengths(LONG_TAILED[args.time_lengths], seed=args.time_seed), args.time_seq, 1)[0]
    rows = []
    for world_size in args.time_cp:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        fd, init_file = tempfile.mkstemp(prefix="cp_balance_bench_")
        os.close(fd)
        os.unlink(init_file)
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, args, bounds, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        per_rank = dict(results.get() for _ in procs)
        for p in procs:
            p.join()
        plain = [per_rank[r][("zigzag", False)] for r in sorted(per_rank)]
        for sharding in SHARDINGS:
            masked = [per_rank[r][(sharding, True)] for r in sorted(per_rank)]
            area = attention_area([bounds], args.time_seq, world_size, sharding)
            rows.append(
                {
                    "cp": world_size,
                    "sharding": sharding,
                    "documents": len(bounds) - 1,
                    "masked_wall_seconds": max(wall for wall, _ in masked),
                    "masked_cpu_seconds_per_rank": [cpu for _, cpu in masked],
                    "unmasked_zigzag_wall_seconds": max(wall for wall, _ in plain),
                    "unmasked_zigzag_cpu_seconds_per_rank": [cpu for _, cpu in plain],
                    "busiest_over_mean": area.busiest_over_mean,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--time-seq", type=int, default=16384)
    parser.add_argument("--time-cp", type=int, nargs="*", default=[2, 4])
    parser.add_argument(
        "--time-lengths", choices=sorted(LONG_TAILED), default="pareto (alpha 1.1, min 100)"
    )
    parser.add_argument("--time-seed", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    corpus = real_corpus_lengths()
    print(
        f"{REAL_CORPUS}: {len(corpus)} documents, {sum(corpus)} tokens, median "
        f"{statistics.median(corpus):.0f}, largest {max(corpus)}\n"
    )
    areas = area_table(args.seq, args.sequences, corpus)
    print(
        f"S = {args.seq}, {args.sequences} packed sequences per distribution; busiest ring "
        "rank's masked attention area over the mean, worst (mean) over the sequences\n"
    )
    print("| lengths | docs/seq | CP | " + " | ".join(SHARDINGS) + " |")
    print("|---|---|---|" + "---|" * len(SHARDINGS))
    for i in range(0, len(areas), len(SHARDINGS)):
        group = areas[i : i + len(SHARDINGS)]
        cells = " | ".join(
            f"{r['worst_busiest_over_mean']:.3f} ({r['mean_busiest_over_mean']:.3f})" for r in group
        )
        print(
            f"| {group[0]['distribution']} | {group[0]['documents_per_sequence']:.0f} | "
            f"{group[0]['cp']} | {cells} |"
        )
    timed = time_table(args) if args.time_cp else []
    if timed:
        print(
            f"\nS = {args.time_seq}, the first packed sequence of {args.time_lengths}, seed "
            f"{args.time_seed}, H={args.heads} "
            f"D={args.head_dim} fp32, ring fwd+bwd seconds (median of {args.reps}, slowest "
            "rank's wall time; and each rank's thread CPU time, which sharing cores does not "
            "inflate), one torch thread per gloo process\n"
        )
        print(
            "| CP | docs | sharding | busiest/mean area | masked CPU s per rank | busiest/mean "
            "CPU | masked wall s | unmasked zigzag wall s | unmasked zigzag CPU s per rank |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in timed:
            cpu = r["masked_cpu_seconds_per_rank"]
            print(
                f"| {r['cp']} | {r['documents']} | {r['sharding']} | "
                f"{r['busiest_over_mean']:.3f} | {', '.join(f'{c:.2f}' for c in cpu)} | "
                f"{max(cpu) * len(cpu) / sum(cpu):.3f} | {r['masked_wall_seconds']:.2f} | "
                f"{r['unmasked_zigzag_wall_seconds']:.2f} | "
                f"{', '.join(f'{c:.2f}' for c in r['unmasked_zigzag_cpu_seconds_per_rank'])} |"
            )
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items() if k != "out"},
                    "machine": f"{platform.processor() or platform.machine()}, "
                    f"{os.cpu_count()} cores, torch {torch.__version__}",
                    "real_corpus": {
                        "name": REAL_CORPUS,
                        "documents": len(corpus),
                        "tokens": sum(corpus),
                        "median": statistics.median(corpus),
                        "largest": max(corpus),
                    },
                    "areas": areas,
                    "times": timed,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
