"""Import time and peak memory per rank of `model.init_from` (a Hugging Face Llama checkpoint),
against the seeded random initialisation of the same model, at 1 and 2 ranks.

    .venv/bin/python benchmarks/hf_import.py --dir /tmp/llama-1b [--preset llama3.2-1b]
        [--ranks 1 2] [--layout tp|fsdp]

First writes a random checkpoint of the preset's shape to DIR (bf16, as the released Llama 3.2
files are; 5 GB shards with model.safetensors.index.json; kept for later runs). Then, in
fresh processes (gloo over loopback), each rank builds the model on the meta device and runs
`parallelize` (which materialises its share: from the checkpoint, or from the seeded
generator), timing that call and reading the process's peak RSS (VmHWM; fp32 parameters:
ctxlaunch's master weights). Layout tp splits every weight over the ranks (TP); fsdp keeps TP 1 and shards
each weight's rows over DP with FSDP2 (ZeRO-3). Prints one JSON line per (ranks, source).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path


def make_checkpoint(directory: Path, preset: str) -> None:
    """A random bf16 LlamaForCausalLM checkpoint of the preset's shape (one tensor in memory
    at a time)."""
    import torch
    from safetensors.torch import save_file

    from ctxlaunch.contract.families import MODEL_PRESETS

    m = MODEL_PRESETS[preset]
    h, f, v, heads, kv = m["hidden"], m["ffn_hidden"], m["vocab"], m["heads"], m["kv_heads"]
    d = h // heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not m["tie_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if size + tensor.numel() * 2 > 5 * 10**9 and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.numel() * 2
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
        shard.clear()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {
                    "total_size": sum(s.stat().st_size for s in directory.glob("*.safetensors"))
                },
                "weight_map": weight_map,
            }
        )
    )
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": h,
                "intermediate_size": f,
                "num_hidden_layers": m["layers"],
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "vocab_size": v,
                "rms_norm_eps": m["norm_eps"],
                "rope_theta": m["rope_theta"],
                "tie_word_embeddings": m["tie_embeddings"],
                "max_position_embeddings": 131072,
                "torch_dtype": "bfloat16",
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            }
        )
    )


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM): unlike getrusage's ru_maxrss it starts afresh
    at exec, so a spawned rank does not inherit its parent's peak. It counts the checkpoint's
    pages mapped by safetensors (file-backed, reclaimable) as well as the parameters."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(rank, world, init_file, spec_data, results):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.parallel.parallelize import parallelize_job

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    with torch.device("meta"):
        model = Transformer.from_spec(spec.model)
    before = peak_rss_bytes()
    start = time.perf_counter()
    parts = parallelize_job(model, spec, ctx=ctx, device=torch.device("cpu"))
    seconds = time.perf_counter() - start
    held = sum(getattr(q, "_local_tensor", q).numel() for _, q in parts.named_parameters())
    results.put(
        {
            "rank": rank,
            "seconds": seconds,
            "params_held": held,
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_before_bytes": before,
        }
    )
    if world > 1:
        dist.destroy_process_group()


def run(world: int, spec_data: dict) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="hf_import_")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(target=_worker, args=(r, world, init_file, spec_data, results))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    out = [results.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
    return sorted(out, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layout", choices=["tp", "fsdp"], default="tp")
    parser.add_argument("--sources", nargs="+", default=["hf", "random"])
    args = parser.parse_args()
    if not (args.dir / "config.json").is_file():
        start = time.perf_counter()
        make_checkpoint(args.dir, args.preset)
        print(json.dumps({"made": str(args.dir), "seconds": time.perf_counter() - start}))
    for world in args.ranks:
        for source in args.sources:
            model = {"init_from": str(args.dir)} if source == "hf" else {"preset": args.preset}
            parallel = {"tp": world} if args.layout == "tp" else {}
            training = (
                {"seq_len": 4096, "zero_stage": 3, "engine": "fsdp2"}
                if args.layout == "fsdp"
                else {"seq_len": 4096}
            )
            spec = {
                "name": "hf-import",
                "model": {**model, "dtype": "fp32"},
                "training": training,
                "parallel": parallel,
                "cluster": {"gpu": "cpu", "gpus_per_node": world},
            }
            for row in run(world, spec):
                print(
                    json.dumps({"ranks": world, "layout": args.layout, "source": source, **row}),
                    flush=True,
                )


if __name__ == "__main__":
    main()
