"""The checks only a GPU can answer, as one prepared script for a lent GPU machine.

    python benchmarks/gpu_check.py --output gpu_check.json        # on the GPU: everything
    python benchmarks/gpu_check.py --dry-run --output dry.json    # the same code paths on a CPU

1. Planner against a real OOM: for llama3.2-1b with no activation checkpointing on one GPU, the
   longest sequence the planner says fits trains two steps; one 15 % longer hits a real CUDA OOM
   that the trainer reports as it does elsewhere (exit 86, the log line with what would fit, the
   OOM counter and event pushed to a real Pushgateway when one is given with --pushgateway-binary).
   Each run is the real trainer (`python -m ctxlaunch.runtime.trainer`) in its own process.
2. Trainer MFU and memory: the llama3.2-1b shape at 16K and 64K tokens, bf16, ZeRO-0, selective
   checkpointing, one GPU, each in its own process: tokens/s, MFU in both conventions against
   the GPU table's dense BF16 peak (goal: >= 45 % causal), and the planner's predicted peak
   against `torch.cuda.max_memory_allocated` / `max_memory_reserved` (goal: within 5 %).
3. Exactness on the device: ring, Ulysses and hybrid block schedules computed in one process
   (every rank's blocks merged through the log-sum-exp, backward from the merged out/lse, dK/dV
   summed at their owner) in bf16 and fp16 against a float64 reference: out, lse, dq, dk, dv;
   GQA; head dim 64 and 128; causal and not; the kernel the code picks named. Each schedule's
   error is judged against one kernel call over the whole sequence on the same inputs.
2b. The same step's matmuls and attention calls alone (`kernels_alone`: staged inputs, CUDA
   events over 20 back-to-back iterations): the MFU they reach by themselves at 16K and 64K,
   and the trainer's MFU over it (goal: >= 0.9), with the attention kernel named.
4. Ring schedule efficiency: the zigzag 8-way ring's forward+backward at 16K and 64K tokens
   against one flash call over the whole sequence (goal: >= 0.90 at 64K, 0.75 at 16K) and
   against the same blocks run alone with staged inputs and no merges (the kernel-only
   ceiling); sharding outside the timed region, CUDA events over 20 back-to-back iterations.

`--dry-run` runs all four on the CPU at toy sizes (fp32 kernels, the tiny model, an injected
OOM instead of a real one), so the script is known to work before device time is spent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# --- 1 and 2: the trainer in its own process ----------------------------------------------------
def trainer_spec(
    model: str, seq: int, checkpointing: str, steps: int, gpu: str, pushgateway: str | None
) -> dict:
    spec = {
        "name": f"gpu-check-{seq}",
        "model": {"preset": model, "dtype": "bf16"},
        "training": {
            "seq_len": seq,
            "steps": steps,
            "activation_checkpointing": checkpointing,
            "zero_stage": 0,
        },
        "cluster": {"target": "local", "gpu": gpu, "gpus_per_node": 1},
    }
    if pushgateway:
        spec["telemetry"] = {
            "prometheus": "push",
            "pushgateway_url": pushgateway,
            "push_interval_seconds": 1,
        }
    return spec


def planner_figures(spec_data: dict) -> dict:
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.memory import estimate, longest_sequence

    spec = validate_spec(spec_data)
    layout = Layout.from_spec(spec)
    est = estimate(spec.model, layout, spec.cluster.gpu_info)
    return {
        "predicted_total_bytes": est.total,
        "predicted_without_allowance_bytes": est.total - est.allowance,
        "predicted_parts_bytes": dict(est.parts()),
        "longest_fitting_seq": longest_sequence(
            spec.model, layout, spec.cluster.gpu_info, spec.parallel.cp_sharding
        ),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_trainer(
    spec_data: dict, workdir: Path, env_extra: dict | None = None, timeout: float = 240
) -> dict:
    """One rank of the real trainer in its own process; its exit status, log and summary."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_data))
    run_dir = workdir / "run"
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
        **(env_extra or {}),
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxlaunch.runtime.trainer",
            str(spec_path),
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = {
        "exit_status": proc.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "log_tail": (proc.stdout + proc.stderr)[-3000:],
    }
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        out["steps"] = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return out


def pushed_metrics(pushgateway: str | None, job: str, prefix: str = "ctxlaunch_") -> dict:
    """The series the trainer pushed for `job` (its spec name is a label value): name{labels}
    -> value, read back from the Pushgateway."""
    if not pushgateway:
        return {}
    text = urllib.request.urlopen(f"{pushgateway}/metrics", timeout=10).read().decode()
    series = {}
    for line in text.splitlines():
        if line.startswith(prefix) and f'"{job}"' in line:
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def pushed(series: dict, metric: str) -> float | None:
    values = [v for name, v in series.items() if name.split("{")[0] == metric]
    return max(values) if values else None


def fit_probe(gpu: str, model: str, pushgateway: str | None, workdir: Path, dry_run: bool) -> dict:
    """The planner's longest fitting sequence trains; 15 % longer is a real OOM (exit 86).
    A dry run caps the length (a CPU has no device allocator to exhaust) and injects the OOM."""
    from ctxlaunch.perf.memory import sequence_granularity

    probe = planner_figures(trainer_spec(model, 8192, "none", 2, gpu, None))
    longest = min(probe["longest_fitting_seq"], 2048) if dry_run else probe["longest_fitting_seq"]
    unit = sequence_granularity(1)
    longer = math.ceil(longest * 1.15 / unit) * unit
    result = {
        "model": model,
        "activation_checkpointing": "none",
        "planner_longest": longest,
        "longer_by_15_percent": longer,
    }
    fits_spec = trainer_spec(model, longest, "none", 2, gpu, None)
    result["at_longest"] = {**run_trainer(fits_spec, workdir / "fit"), **planner_figures(fits_spec)}
    oom_spec = trainer_spec(model, longer, "none", 2, gpu, pushgateway)
    env = {"CTXLAUNCH_INJECT_FAULT": "kind=oom,rank=0,step=1"} if dry_run else None
    result["at_longer"] = run_trainer(oom_spec, workdir / "oom", env)
    result["at_longer"]["injected"] = dry_run
    series = pushed_metrics(pushgateway, oom_spec["name"], "ctxlaunch_oom")
    result["at_longer"]["pushed_oom_series"] = series
    exit_file = workdir / "oom" / "run" / "exit" / "rank-0"
    result["at_longer"]["recorded_exit"] = (
        exit_file.read_text().strip() if exit_file.exists() else None
    )
    return result


def mfu_run(
    gpu: str, model: str, seq: int, steps: int, workdir: Path, pushgateway: str | None
) -> dict:
    """Trainer throughput, MFU and memory at one sequence length, in its own process; peak
    reserved memory comes from what its telemetry pushed."""
    spec_data = trainer_spec(model, seq, "selective", steps + 3, gpu, pushgateway)
    run = run_trainer(spec_data, workdir / f"mfu-{seq}")
    out = {"seq_len": seq, "exit_status": run["exit_status"], **planner_figures(spec_data)}
    steps_seen = run.get("steps", [])
    timed = steps_seen[3:] or steps_seen
    if run["exit_status"] != 0 or not timed:
        out["log_tail"] = run["log_tail"]
        return out
    from ctxlaunch.contract.hardware import gpu_info

    peak = gpu_info(gpu).peak_bf16_flops
    mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
    out.update(
        tokens_per_second=mean("tokens_per_second_per_gpu"),
        mfu_causal=mean("model_tflops_per_gpu_causal") * 1e12 / peak,
        mfu_full=mean("model_tflops_per_gpu_full") * 1e12 / peak,
        step_seconds=mean("step_seconds"),
        max_allocated_bytes=max(s["peak_memory_bytes"] for s in steps_seen),
        max_reserved_bytes=pushed(
            pushed_metrics(pushgateway, spec_data["name"]), "ctxlaunch_memory_peak_reserved_bytes"
        ),
    )
    alloc = out["max_allocated_bytes"]
    out["predicted_over_allocated"] = out["predicted_without_allowance_bytes"] / alloc
    if out["max_reserved_bytes"]:
        out["predicted_total_over_reserved"] = (
            out["predicted_total_bytes"] / out["max_reserved_bytes"]
        )
    return out


def kernels_alone(
    device: str, gpu: str, model: str, seq: int, checkpointing: str, repeats: int
) -> dict:
    """The matmuls and attention calls one trainer step at `seq` makes (every block's
    projections forward and backward, the feed-forward's forward again under selective
    checkpointing, the output head, causal attention forward and backward through the
    trainer's own kernels), timed alone back to back on staged inputs: the MFU those kernels
    reach by themselves, the ceiling the trainer's MFU is compared with. No pointwise work, no
    loss, no optimizer, no allocation inside the timed region."""
    import torch

    from ctxlaunch.contract.hardware import gpu_info
    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.cp import kernels
    from ctxlaunch.perf.flops import flops_per_token

    spec = validate_spec(trainer_spec(model, seq, checkpointing, 1, gpu, None))
    m = spec.model
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    d = m.hidden // m.heads
    shapes = [
        (m.hidden, (m.heads + 2 * m.kv_heads) * d),
        (m.heads * d, m.hidden),
        (m.hidden, 2 * m.ffn_hidden),
        (m.ffn_hidden, m.hidden),
    ]
    recomputed = (
        shapes[2:] if checkpointing == "selective" else shapes if checkpointing == "full" else []
    )
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    staged = [(make(seq, k), make(k, n), make(seq, n)) for k, n in shapes]
    recompute = [(make(seq, k), make(k, n)) for k, n in recomputed]
    head = (make(seq, m.hidden), make(m.hidden, m.vocab), make(seq, m.vocab))
    q = make(1, m.heads, seq, d)
    k, v = make(1, m.kv_heads, seq, d), make(1, m.kv_heads, seq, d)
    grad = make(1, m.heads, seq, d)
    scale = d**-0.5

    def layer_matmuls() -> None:
        for x, w, g in staged:
            x @ w
            g @ w.t()
            x.t() @ g
        for x, w in recompute:
            x @ w

    def head_matmuls() -> None:
        x, w, g = head
        x @ w
        g @ w.t()
        x.t() @ g

    def attention() -> None:
        out, lse = kernels.attention_forward(q, k, v, True, scale)
        kernels.attention_backward(grad, q, k, v, out, lse, True, scale)

    def timed(fn) -> float:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats
        begin = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - begin) / repeats

    t_matmul, t_head, t_attention = timed(layer_matmuls), timed(head_matmuls), timed(attention)
    step = m.layers * (t_matmul + t_attention) + t_head
    peak = gpu_info(gpu).peak_bf16_flops
    return {
        "seq_len": seq,
        "checkpointing": checkpointing,
        "dtype": str(dtype),
        "repeats": repeats,
        "attention_kernel": (kernels.cuda_kernel_name(q) if device == "cuda" else "cpu flash"),
        "block_matmuls_s": t_matmul,
        "block_attention_s": t_attention,
        "head_s": t_head,
        "step_s": step,
        "tokens_per_second": seq / step,
        "mfu_causal": seq * flops_per_token(m, seq, "causal") / step / peak,
        "mfu_full": seq * flops_per_token(m, seq, "full") / step / peak,
    }


def trainer_against_kernels(trainer: list[dict], alone: list[dict]) -> list[dict]:
    """Per length, the trainer's MFU over the MFU of its kernels alone (goal: >= 0.9)."""
    rows = []
    for run, kern in zip(trainer, alone, strict=True):
        row = {
            "seq_len": kern["seq_len"],
            "kernels_mfu_causal": kern["mfu_causal"],
            "trainer_mfu_causal": run.get("mfu_causal"),
        }
        if run.get("mfu_causal") is not None:
            row["trainer_over_kernels"] = run["mfu_causal"] / kern["mfu_causal"]
        rows.append(row)
    return rows


# --- 3 and 4: the CP block schedules in one process ---------------------------------------------
def stage_ring(q, k, v, grad, ranks: int, layout: str) -> dict:
    """Every rank's shards of q, k, v and the upstream gradient, cut once (outside any timing),
    as `shard_sequence` would hand them to each rank."""
    from ctxlaunch.cp.sharding import shard_for_rank

    return {
        name: [shard_for_rank(t, r, ranks, 2, layout) for r in range(ranks)]
        for name, t in (("q", q), ("k", k), ("v", v), ("grad", grad))
    }


def ring_blocks(ranks: int, causal: bool, layout: str, s_local: int) -> tuple[list, list]:
    """The ring's block schedule (`ring._block`, `ring._diagonal_parts`): per rank the forward
    blocks ``(src, rows, kv_rows, causal)`` in ring step order, and the backward blocks in the
    order `_ring_backward` runs them (diagonal first half, the other ranks' blocks, second half)."""
    from ctxlaunch.cp.ring import _block, _diagonal_parts

    forward, backward = [], []
    for rank in range(ranks):
        steps = [
            ((rank - step) % ranks, _block(rank, (rank - step) % ranks, causal, layout, s_local))
            for step in range(ranks)
        ]
        forward.append([(src, *block) for src, block in steps if block is not None])
        first, last = _diagonal_parts(causal, s_local)
        backward.append(
            [(rank, *part) for part in first]
            + [(src, *block) for src, block in steps[1:] if block is not None]
            + [(rank, *part) for part in last]
        )
    return forward, backward


class RingRun:
    """What an N-rank ring computes, rank by rank in one process, as `ctxlaunch.cp.ring` does it:
    the same blocks, kernels (`kernels.attention_forward/backward` on views of the shards), the
    same in-place merge into fp32 accumulators with a reused scratch (`merge.merge_block`: the
    compiled merge on CUDA), and dq/dk/dv accumulated in place in fp32 at their owners. Every
    buffer is allocated here, once; `run()` is what a timed iteration repeats. What it leaves
    out is the ring's transfers (one process holds every shard)."""

    def __init__(
        self,
        staged: dict,
        ranks: int,
        causal: bool,
        scale: float,
        layout: str,
        backward: bool = True,
    ):
        import torch

        from ctxlaunch.cp.merge import MergeScratch

        self.s, self.ranks, self.causal, self.scale = staged, ranks, causal, scale
        self.backward, self.layout = backward, layout
        self.forward_blocks, self.backward_blocks = ring_blocks(
            ranks, causal, layout, staged["q"][0].size(2)
        )
        acc = torch.promote_types(staged["q"][0].dtype, torch.float32)
        self.out = [torch.empty_like(x, dtype=acc) for x in staged["q"]]
        self.lse = [x.new_empty(x.shape[:3], dtype=acc) for x in staged["q"]]
        self.scratch = [MergeScratch(o) for o in self.out]
        self.out_final = [torch.empty_like(x) for x in staged["q"]]
        self.dq = [torch.empty_like(x, dtype=acc) for x in staged["q"]]
        self.dk = [torch.empty_like(x, dtype=acc) for x in staged["k"]]
        self.dv = [torch.empty_like(x, dtype=acc) for x in staged["v"]]

    def run(self) -> None:
        from ctxlaunch.cp import kernels
        from ctxlaunch.cp.merge import merge_block

        s = self.s
        for rank, blocks in enumerate(self.forward_blocks):
            out, lse = self.out[rank], self.lse[rank]
            for i, (src, rows, kv_rows, block_causal) in enumerate(blocks):
                b_out, b_lse = kernels.attention_forward(
                    s["q"][rank][:, :, rows],
                    s["k"][src][:, :, kv_rows],
                    s["v"][src][:, :, kv_rows],
                    block_causal,
                    self.scale,
                )
                if i == 0:  # the diagonal block covers every row
                    out.copy_(b_out)
                    lse.copy_(b_lse)
                else:
                    merge_block(out[:, :, rows], lse[:, :, rows], b_out, b_lse, self.scratch[rank])
            self.out_final[rank].copy_(out)
        if not self.backward:
            return
        for t in self.dq + self.dk + self.dv:
            t.zero_()
        for rank, blocks in enumerate(self.backward_blocks):
            for src, rows, kv_rows, block_causal in blocks:
                dq, dk, dv = kernels.attention_backward(
                    s["grad"][rank][:, :, rows],
                    s["q"][rank][:, :, rows],
                    s["k"][src][:, :, kv_rows],
                    s["v"][src][:, :, kv_rows],
                    self.out_final[rank][:, :, rows],
                    self.lse[rank][:, :, rows],
                    block_causal,
                    self.scale,
                )
                self.dq[rank][:, :, rows] += dq
                self.dk[src][:, :, kv_rows] += dk
                self.dv[src][:, :, kv_rows] += dv

    def result(self, like) -> dict:
        from ctxlaunch.cp.sharding import unshard_from_shards

        result = {
            "out": unshard_from_shards(self.out_final, 2, self.layout),
            "lse": unshard_from_shards(self.lse, 2, self.layout),
        }
        if self.backward:
            for name, parts in (("dq", self.dq), ("dk", self.dk), ("dv", self.dv)):
                result[name] = unshard_from_shards(
                    [p.to(like.dtype) for p in parts], 2, self.layout
                )
        return result


class KernelCeiling:
    """The same blocks run alone: each block's inputs staged beforehand as the dense tensors the
    kernel reads (and, for backward, the final out and lse rows), no merges, no accumulation.
    What the ring's kernels cost with nothing around them."""

    def __init__(self, staged: dict, ranks: int, causal: bool, scale: float, layout: str):
        from ctxlaunch.cp import kernels

        forward, backward = ring_blocks(ranks, causal, layout, staged["q"][0].size(2))
        s = staged
        dense = lambda t: t.contiguous()  # noqa: E731
        self.forward = [
            (
                dense(s["q"][r][:, :, rows]),
                dense(s["k"][src][:, :, kv]),
                dense(s["v"][src][:, :, kv]),
                c,
            )
            for r, blocks in enumerate(forward)
            for src, rows, kv, c in blocks
        ]
        run = RingRun(staged, ranks, causal, scale, layout, backward=False)
        run.run()
        self.backward = [
            (
                dense(s["grad"][r][:, :, rows]),
                dense(s["q"][r][:, :, rows]),
                dense(s["k"][src][:, :, kv]),
                dense(s["v"][src][:, :, kv]),
                dense(run.out_final[r][:, :, rows]),
                dense(run.lse[r][:, :, rows]),
                c,
            )
            for r, blocks in enumerate(backward)
            for src, rows, kv, c in blocks
        ]
        self.scale, self.kernels = scale, kernels

    def run(self) -> None:
        for q, k, v, c in self.forward:
            self.kernels.attention_forward(q, k, v, c, self.scale)
        for g, q, k, v, o, lse, c in self.backward:
            self.kernels.attention_backward(g, q, k, v, o, lse, c, self.scale)


def ring_schedule(
    q, k, v, grad, ranks: int, causal: bool, layout: str, scale: float, backward: bool = True
):
    """`RingRun` on fresh shards of q, k, v, grad; the full (unsharded) out, lse and, with
    `backward`, dq, dk, dv."""
    run = RingRun(stage_ring(q, k, v, grad, ranks, layout), ranks, causal, scale, layout, backward)
    run.run()
    return run.result(q)


def head_split_schedule(
    q, k, v, grad, ulysses: int, ring: int, causal: bool, layout: str, scale: float
):
    """Ulysses (ring = 1) and hybrid: after the all-to-all, Ulysses rank u holds heads
    u*H/U..(u+1)*H/U of q and of k/v over its whole (sub)sequence; hybrid runs a ring of
    `ring` ranks on each such head group. Heads are contiguous blocks, as the all-to-all cuts
    them."""
    import torch

    from ctxlaunch.cp import kernels

    hq, hkv = q.size(1) // ulysses, k.size(1) // ulysses
    parts = []
    for u in range(ulysses):
        qh, gh = q[:, u * hq : (u + 1) * hq], grad[:, u * hq : (u + 1) * hq]
        kh, vh = k[:, u * hkv : (u + 1) * hkv], v[:, u * hkv : (u + 1) * hkv]
        if ring > 1:
            parts.append(ring_schedule(qh, kh, vh, gh, ring, causal, layout, scale))
            continue
        out, lse = kernels.attention_forward(qh, kh, vh, causal, scale)
        dq, dk, dv = kernels.attention_backward(gh, qh, kh, vh, out, lse, causal, scale)
        parts.append({"out": out, "lse": lse, "dq": dq, "dk": dk.to(k.dtype), "dv": dv.to(v.dtype)})
    return {name: torch.cat([p[name] for p in parts], dim=1) for name in parts[0]}


def reference(q, k, v, grad, causal: bool, scale: float):
    """Plain-math float64 attention on the inputs' device: out, lse, dq, dk, dv."""
    import torch

    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.size(1) // k.size(1)
    kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ kr.transpose(-1, -2)) * scale
    if causal:
        n = scores.size(-1)
        scores = scores.masked_fill(
            torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vr
    out.backward(grad.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def max_errors(got: dict, want: dict) -> dict:
    """Max absolute error of each tensor, scaled by the reference's max magnitude."""
    return {
        name: float(
            (got[name].double() - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-12)
        )
        for name in want
    }


def exactness(device: str, dtypes: list[str], seq: int, ranks: int) -> dict:
    import torch

    from ctxlaunch.cp import kernels

    cases = []
    worst_ratio = 0.0
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for head_dim in (64, 128):
            for causal in (True, False):
                g = torch.Generator(device=device).manual_seed(head_dim + causal)
                # GQA: 8 query heads over 2 K/V heads; Ulysses 2 keeps one K/V head per rank.
                q = torch.randn(1, 8, seq, head_dim, device=device, generator=g).to(dtype)
                k, v = (
                    torch.randn(1, 2, seq, head_dim, device=device, generator=g).to(dtype)
                    for _ in range(2)
                )
                grad = torch.randn(1, 8, seq, head_dim, device=device, generator=g).to(dtype)
                scale = head_dim**-0.5
                want = reference(q, k, v, grad, causal, scale)
                whole = head_split_schedule(q, k, v, grad, 1, 1, causal, "zigzag", scale)
                base = max_errors(whole, want)
                kernel = kernels.cuda_kernel_name(q) if q.device.type == "cuda" else "flash (cpu)"
                schedules = {
                    f"ring-{ranks}": ring_schedule(q, k, v, grad, ranks, causal, "zigzag", scale),
                    "ring-2-contiguous": ring_schedule(
                        q, k, v, grad, 2, causal, "contiguous", scale
                    ),
                    "ulysses-2": head_split_schedule(q, k, v, grad, 2, 1, causal, "zigzag", scale),
                    f"hybrid-2x{ranks // 2}": head_split_schedule(
                        q, k, v, grad, 2, ranks // 2, causal, "zigzag", scale
                    ),
                }
                for name, got in schedules.items():
                    errors = max_errors(got, want)
                    # The schedule may not be much worse than one kernel call on the same data.
                    ratio = max(errors[t] / max(base[t], 1e-7) for t in errors)
                    worst_ratio = max(worst_ratio, ratio)
                    cases.append(
                        {
                            "schedule": name,
                            "dtype": dtype_name,
                            "head_dim": head_dim,
                            "causal": causal,
                            "kernel": kernel,
                            "errors": errors,
                            "one_call_errors": base,
                            "ratio_to_one_call": ratio,
                            "ok": ratio <= 2.0,
                        }
                    )
    return {
        "seq_len": seq,
        "heads": 8,
        "kv_heads": 2,
        "cases": cases,
        "worst_ratio_to_one_call": worst_ratio,
        "all_ok": all(c["ok"] for c in cases),
    }


def ring_schedule_efficiency(
    device: str, seq: int, ranks: int, heads: int, kv_heads: int, head_dim: int, iterations: int
) -> dict:
    """The zigzag ring's fwd+bwd (`RingRun`) against one kernel call over the whole sequence and
    against its own blocks alone (`KernelCeiling`). Shards, buffers and staged block inputs are
    made before timing; each figure is the mean of ``iterations`` back-to-back runs after two
    warm-ups, timed by CUDA events around the whole batch (wall clock on the CPU)."""
    import torch

    from ctxlaunch.cp import kernels

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype) for _ in range(2))
    grad = torch.randn_like(q)
    scale = head_dim**-0.5
    staged = stage_ring(q, k, v, grad, ranks, "zigzag")

    def full() -> None:
        out, lse = kernels.attention_forward(q, k, v, True, scale)
        kernels.attention_backward(grad, q, k, v, out, lse, True, scale)

    ring = RingRun(staged, ranks, True, scale, "zigzag")
    ceiling = KernelCeiling(staged, ranks, True, scale, "zigzag")

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        if device != "cuda":
            start = time.perf_counter()
            for _ in range(iterations):
                fn()
            return (time.perf_counter() - start) / iterations
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iterations):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000 / iterations

    t_full, t_ring, t_ceiling = timed(full), timed(ring.run), timed(ceiling.run)
    blocks = len(ceiling.forward) + len(ceiling.backward)
    return {
        "seq_len": seq,
        "ranks": ranks,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(dtype),
        "iterations": iterations,
        "kernel_calls": blocks,
        "merge": ("compiled" if device == "cuda" else "eager"),
        "one_call_s": t_full,
        "ring_s": t_ring,
        "blocks_alone_s": t_ceiling,
        "ring_over_one_call": t_full / t_ring,
        "blocks_alone_over_one_call": t_full / t_ceiling,
        "ring_over_blocks_alone": t_ceiling / t_ring,
    }


def saved_tensors_probe(device: str, model_name: str, seqs: tuple[int, ...]) -> list[dict]:
    """What one and two blocks of the trainer's model (ZeRO-0: fp32 weights under bf16 autocast)
    save for backward on this device, tensor by tensor, and the device's own count of live and
    peak memory around one forward+backward, against the planner's per-token figures. The
    difference between the one- and two-block runs is one block, free of the loss head."""
    import torch

    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.memory import (
        activation_bytes,
        autocast_weight_copy_bytes,
        block_activation_bytes_per_token,
    )
    from ctxlaunch.runtime.modeling.model import Transformer
    from devkit.memtrace import SavedTensorMeter

    class Listing(SavedTensorMeter):
        def __init__(self, exclude):
            super().__init__(exclude)
            self.tensors: dict[int, str] = {}

        def _pack(self, tensor):
            key = tensor.untyped_storage().data_ptr()
            if key not in self._exclude and key not in self.tensors:
                self.tensors[key] = (
                    f"{tuple(tensor.shape)} {str(tensor.dtype)[6:]} "
                    f"{tensor.untyped_storage().nbytes()}"
                )
            return super()._pack(tensor)

    cuda = device == "cuda"
    rows = []
    for mode in ("none", "selective"):
        for seq in seqs:
            for layers in (1, 2):
                spec = validate_spec(
                    {
                        "name": "probe",
                        "model": {"preset": model_name, "dtype": "bf16", "layers": layers},
                        "training": {"seq_len": seq, "activation_checkpointing": mode},
                        "cluster": {"target": "local", "gpu": "H200" if cuda else "cpu"},
                    }
                )
                model = Transformer.from_spec(spec.model)
                model.set_checkpointing(mode)
                model.to(device)
                tokens = torch.randint(0, spec.model.vocab, (1, seq), device=device)
                positions = torch.arange(seq, device=device)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                with Listing(exclude=list(model.parameters())) as meter:
                    with torch.autocast(device, dtype=torch.bfloat16):
                        loss = model(tokens, positions, tokens)
                row = {"mode": mode, "seq": seq, "layers": layers, "saved_bytes": meter.bytes}
                if cuda:
                    row["live_after_forward"] = torch.cuda.memory_allocated() - base
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                    row["peak_over_weights"] = torch.cuda.max_memory_allocated() - base
                layout = Layout.from_spec(spec)
                row["planner_block_saved_per_token"] = block_activation_bytes_per_token(
                    spec.model, layout
                )
                row["planner_autocast_copies_per_block"] = autocast_weight_copy_bytes(
                    spec.model, layout
                )
                row["planner_activations"] = activation_bytes(spec.model, layout)
                if layers == 1 and seq == seqs[0]:
                    row["tensors"] = sorted(meter.tensors.values())
                rows.append(row)
                del model, loss, meter
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def peak_allocations(model_name: str, seq: int, mode: str) -> dict:
    """CUDA only: replay the allocator's own trace of one forward+backward of a one-block model
    and list what is live at the peak, grouped by the innermost ctxlaunch/torch frame."""
    import torch

    from ctxlaunch.contract.loader import validate_spec
    from ctxlaunch.runtime.modeling.model import Transformer

    spec = validate_spec(
        {
            "name": "probe",
            "model": {"preset": model_name, "dtype": "bf16", "layers": 1},
            "training": {"seq_len": seq, "activation_checkpointing": mode},
            "cluster": {"target": "local", "gpu": "H200"},
        }
    )
    model = Transformer.from_spec(spec.model)
    model.set_checkpointing(mode)
    model.to("cuda")
    tokens = torch.randint(0, spec.model.vocab, (1, seq), device="cuda")
    positions = torch.arange(seq, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens, positions, tokens)
    loss.backward()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                frames = [
                    f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                    for f in event.get("frames", [])
                    if "ctxlaunch" in f["filename"] or "gpu_check" in f["filename"]
                ]
                live[event["addr"]] = (event["size"], " < ".join(frames[:3]))
                total += event["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        groups.setdefault(where, []).append(size)
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "seq": seq,
        "mode": mode,
        "peak_bytes_over_start": peak,
        "live_at_peak": [
            {"where": w, "count": len(v), "bytes": sum(v), "largest": max(v)} for w, v in top
        ],
    }


def start_pushgateway(binary: str | None) -> tuple[subprocess.Popen | None, str | None]:
    if not binary:
        return None, None
    proc = subprocess.Popen(
        [binary, "--web.listen-address=127.0.0.1:9091"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = "http://127.0.0.1:9091"
    for _ in range(50):
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the Pushgateway did not become ready")


def attention_choice(
    device: str, model_name: str, seqs: tuple[int, ...], ranks: int, dry: bool
) -> list[dict]:
    """The trainer's attention-kernel choice (ctxlaunch.cp.kernel_choice) at the model's own
    heads and head dim, for one call over the whole sequence and for the zigzag ring's
    half-block on `ranks` ranks: each candidate's forward+backward time, the refusals, and the
    kernel's TFLOP/s (causal: half of 4*b*s*s*h*d forward, 2.5x that with the backward)."""
    import torch

    from ctxlaunch.contract.spec import ModelSpec
    from ctxlaunch.cp import kernel_choice, kernels

    m = ModelSpec(preset=model_name)
    head_dim = m.hidden // m.heads
    rows = []
    for seq in seqs:
        for label, block in (
            ("whole sequence", seq),
            (f"zigzag {ranks}-rank half-block", seq // ranks // 2),
        ):
            choice = kernel_choice.choose(
                1,
                m.heads,
                m.kv_heads,
                block,
                head_dim,
                torch.bfloat16,
                torch.device(device),
                repeats=3 if dry else 20,
                measure_on_cpu=dry,
            )
            flops = 3.5 * 4 * block * block * m.heads * head_dim / 2
            rows.append(
                {
                    "seq": seq,
                    "call": label,
                    "block": block,
                    "kernel": choice.kernel,
                    "chosen_by": choice.chosen_by,
                    "line": choice.describe(),
                    "tflops_fwd_bwd": {
                        k: round(flops / t / 1e12, 1) for k, t in choice.seconds.items()
                    },
                    "refused": choice.refused,
                }
            )
    kernels.use_cuda_kernel("flash")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, toy sizes, an injected OOM: check the script itself",
    )
    parser.add_argument("--pushgateway-binary", help="start this Pushgateway for the OOM check")
    parser.add_argument(
        "--only", nargs="*", default=["fit", "mfu", "kernels", "attention", "exact", "ring"]
    )
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args()
    dry = args.dry_run
    device, gpu = ("cpu", "cpu") if dry else ("cuda", "H200")
    model = "tiny" if dry else "llama3.2-1b"
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": dry}
    pushgateway_proc, pushgateway = start_pushgateway(args.pushgateway_binary)

    def section(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # one failed section must not cost the others' device time
            import traceback

            results[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        results[name + "_seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({name: results[name]}, indent=1, default=str)[:4000], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # The trainer processes go first, before this process holds any device memory.
        if "fit" in args.only:
            section("fit_probe", lambda: fit_probe(gpu, model, pushgateway, work, dry_run=dry))
        if "mfu" in args.only:
            seqs = (2048, 4096) if dry else (16384, 65536)
            section(
                "trainer",
                lambda: [mfu_run(gpu, model, s, 2 if dry else 4, work, pushgateway) for s in seqs],
            )
    if "kernels" in args.only:
        seqs = (2048, 4096) if dry else (16384, 65536)
        section(
            "kernels_alone",
            lambda: [
                kernels_alone(device, gpu, model, s, "selective", 2 if dry else 20) for s in seqs
            ],
        )
        trainer_rows = results.get("trainer")
        if isinstance(trainer_rows, list) and isinstance(results.get("kernels_alone"), list):
            section(
                "trainer_against_kernels",
                lambda: trainer_against_kernels(trainer_rows, results["kernels_alone"]),
            )
    if "attention" in args.only:
        section(
            "attention_choice",
            lambda: attention_choice(
                device, model, (2048, 4096) if dry else (16384, 65536), 8, dry
            ),
        )
    if "exact" in args.only:
        section(
            "exactness",
            lambda: exactness(
                device, ["float32"] if dry else ["bfloat16", "float16"], 256 if dry else 2048, 4
            ),
        )
    if "saved" in args.only:
        section(
            "saved_tensors",
            lambda: saved_tensors_probe(
                device, "tiny" if dry else "llama3.2-1b", (512, 1024) if dry else (8192, 16384)
            ),
        )
    if "peak" in args.only:
        section(
            "peak_allocations",
            lambda: [peak_allocations("llama3.2-1b", seq, "selective") for seq in (8192, 16384)],
        )
    if "ring" in args.only:
        section(
            "ring_schedule",
            lambda: [
                ring_schedule_efficiency(
                    device,
                    s,
                    8,
                    4 if dry else 32,
                    2 if dry else 8,
                    32 if dry else 128,
                    3 if dry else 20,
                )
                for s in ((1024, 2048) if dry else (16384, 65536))
            ],
        )
    if pushgateway_proc is not None:
        pushgateway_proc.kill()
    write_results(results, args.output, dry)
    print("gpu_check: done", flush=True)


def write_results(results: dict, output: str | None, dry: bool) -> None:
    """Name the GPU and torch in `results` (not in a dry run) and write them to `output`."""
    if not dry:
        import torch

        results["device"] = torch.cuda.get_device_name()
        results["torch"] = torch.__version__
    if output:
        Path(output).write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
