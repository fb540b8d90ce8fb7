"""Tiny random Hugging Face causal LMs of every family ctxlaunch imports (transformers' own
classes, a test-only reference), saved with save_pretrained, and the trainer built from them:
what the import, export and parity tests share.

The models are fp32 with random weights, random norm gains (a swapped mapping of the two
norms, or of q and k, shows) and random biases, so that every mapped tensor matters.
transformers is imported inside the functions: the spawned ranks of the multi-process tests
import the test modules and need none of it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ctxlaunch.contract.loader import apply_overrides, validate_spec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SEQ = 32
VOCAB = 64

ROPES: dict[str, dict] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    # Llama 3.1's scaling, the pretraining length shrunk so every band is hit at SEQ tokens.
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "mscale": 0.8,
        "mscale_all_dim": 0.5,
    },
}

FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # The Llama block with head_dim free of hidden / heads (64 / 4 = 16; Mistral NeMo's case)
    # and no window (Mistral since v0.2).
    "mistral": ("MistralConfig", {"head_dim": 32, "sliding_window": None}),
    # Biases on q, k and v; the released checkpoints' window left off.
    "qwen2": ("Qwen2Config", {"use_sliding_window": False, "sliding_window": 4096}),
    # q/k norms, head_dim free of hidden / heads, no biases.
    "qwen3": ("Qwen3Config", {"head_dim": 32, "use_sliding_window": False}),
    # Local and full layers alternating, scores scaled by 24^-1/2 and soft-capped, final
    # logits soft-capped: caps small enough that tanh bends at these scores.
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    # A local layer, then a full one with its own RoPE base and scaling (rope_parameters per
    # kind, built by hf_config); q/k norms.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # Mixtures of experts: 4 experts, top-2, a load-balancing coefficient large enough for its
    # gradient to show. Qwen3-MoE renormalises the top-2 here (norm_topk_prob).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "use_sliding_window": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.05,
        },
    ),
    # Mixtral: every expert intermediate_size (96) wide, always renormalised.
    "mixtral": (
        "MixtralConfig",
        {
            "sliding_window": None,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.05,
        },
    ),
    # Qwen2-MoE: a shared expert behind its sigmoid gate, q/k/v biases, not renormalised, and
    # layer 1 dense (mlp_only_layers) between sparse ones.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "use_sliding_window": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
            "router_aux_loss_coef": 0.05,
        },
    ),
    # GPT-OSS: q/k/v/o biases, sinks, a local layer (a window of 5, smaller than a CP 2
    # shard) then a full one, 4 experts (intermediate_size wide) with biases, top-2 softmaxed
    # over the two logits, and a SwiGLU limit low enough that the clamps bite at these scores.
    "gpt_oss": (
        "GptOssConfig",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.05,
            "swiglu_limit": 0.5,
        },
    ),
}
"""Per family: transformers' config class and what it sets beyond the shape every tiny model
shares (hidden 64, 4 heads, 2 K/V heads, FFN 96, vocabulary VOCAB)."""


def hf_config(
    rope: str = "llama3",
    *,
    kv_heads: int = 2,
    tied: bool = False,
    layers: int = 2,
    theta: float = 500000.0,
    family: str = "llama",
    vocab: int = VOCAB,
    **changes: Any,
) -> PretrainedConfig:
    """A tiny config of `family` (llama: LlamaConfig; see FAMILY_CONFIGS for the others) with
    a vocabulary of `vocab` ids."""
    import transformers

    name, extra = FAMILY_CONFIGS.get(family, ("LlamaConfig", {}))
    params: dict[str, Any] = {**ROPES[rope], "rope_theta": theta}
    if family == "gemma3":
        params = {
            "full_attention": params,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        rope_parameters=params,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )
    return getattr(transformers, name)(**{**kwargs, **extra, **changes})


def save_hf(
    directory: Path,
    config: PretrainedConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **save_options: Any,
) -> PreTrainedModel:
    """A random causal LM of the config's family (norm gains and biases random too) saved to
    `directory`, with a stand-in tokenizer.json; returned in fp32, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith((".bias", "_bias")):
                param.copy_(0.3 * torch.randn_like(param))
    model = model.to(dtype)
    model.save_pretrained(directory, **save_options)
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    return model.float().eval()


def spec_data(init_from: Path, world: int = 1, **changes: Any) -> dict:
    """A two-step fp32 job of SEQ tokens, global batch 2, from `init_from` on `world` CPU
    ranks, with dotted-path changes."""
    base = {
        "name": "hf",
        "model": {"init_from": str(init_from), "dtype": "fp32"},
        "training": {
            "seq_len": SEQ,
            "micro_batch": 1,
            "global_batch": 2,
            "steps": 2,
            "seed": 3,
            "optimizer": {"lr": 1e-3},
        },
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": world},
    }
    return apply_overrides(base, [f"{k}={v}" for k, v in changes.items()])


def build_trainer(rank: int, world: int, data: dict):  # type: ignore[no-untyped-def]
    """The trainer of spec `data` on this rank (inside `run_distributed`, or rank 0 of 1)."""
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    return Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)


def our_logits(trainer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The one-process trainer's logits of `tokens` (B, S) at positions 0 .. S-1."""
    model = trainer.engine.parts.model
    with torch.no_grad():
        hidden = model.hidden_states(tokens, torch.arange(tokens.shape[1]))
        return model.cap_logits(F.linear(hidden, model._output_weight()))


def one_process(data: dict) -> dict:
    """`data` at one process, ZeRO-0, no parallelism: the layout the references read."""
    return apply_overrides(
        data,
        [
            "cluster.gpus_per_node=1",
            "parallel={}",
            "training.zero_stage=0",
            "training.engine=auto",
        ],
    )


def reference_loss(reference: PreTrainedModel, data: dict) -> float:
    """transformers' mean next-token loss over the first step's sequences (the batches a
    one-process trainer of the same spec reads), over the targets that trainer predicts (the
    others -100, as transformers' labels would mark them)."""
    trainer = build_trainer(0, 1, one_process(data))
    total, count = 0.0, 0
    with torch.no_grad():
        for micro in range(trainer.spec.grad_accum):
            batch = trainer.batches.get(0, micro)
            logits = reference(batch.tokens).logits
            losses = F.cross_entropy(
                logits.flatten(0, 1), batch.targets.flatten(), reduction="sum", ignore_index=-100
            )
            total += float(losses)
            count += int((batch.targets != -100).sum())
    return total / count


def reference_sequences(reference: PreTrainedModel, data: dict) -> list[torch.Tensor]:
    """transformers' logits of the first step's sequences, in order (micro-batch m of DP rank
    r is sequence r at one micro-batch per rank: the layouts here run at most DP 2, the
    one-process trainer reads them as its micro-batches 0, 1)."""
    trainer = build_trainer(0, 1, one_process(data))
    with torch.no_grad():
        return [
            reference(trainer.batches.get(0, m).tokens).logits
            for m in range(trainer.spec.grad_accum)
        ]


def local_logits(trainer) -> dict | None:  # type: ignore[no-untyped-def]
    """This rank's logits (whole vocabulary, gathered over TP) of the first micro-batch's
    tokens it holds, with their global positions; None under PP (no rank runs it all) and
    FSDP2 (the root's weights are gathered only inside its forward): the loss covers those."""
    import torch.distributed as dist

    engine = trainer.engine
    if trainer.ctx.dims.pp > 1 or (hasattr(engine, "parts") and engine.parts.sharded):
        return None
    model = engine.parts.model if hasattr(engine, "parts") else engine.model
    batch = trainer.batches.get(0, 0)
    with torch.no_grad():
        hidden = model.enter_loss(model.hidden_states(batch.tokens, batch.positions))
        logits = F.linear(hidden, model._output_weight())
    if trainer.ctx.dims.tp > 1:
        shards = [torch.empty_like(logits) for _ in range(trainer.ctx.dims.tp)]
        dist.all_gather(shards, logits.contiguous(), group=trainer.ctx.tp_group)
        logits = torch.cat(shards, dim=-1)
    return {"logits": model.cap_logits(logits).numpy(), "positions": batch.positions.numpy()}


def first_losses(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each spec: build the trainer, its logits of the imported weights, one step (its
    loss is that of the imported weights), a checkpoint if the spec says where."""
    results = []
    for data in cases:
        trainer = build_trainer(rank, world, data)
        logits = local_logits(trainer)
        results.append(
            {"loss": trainer.train_step().loss, "logits": logits, "dp_rank": trainer.ctx.dp_rank}
        )
        trainer.save_checkpoint()
    return results


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_layouts_match_transformers(
    ranks: list[list[dict]],
    cases: list[dict],
    references: list[PreTrainedModel],
    names: list[str],
) -> None:
    """Each case's first-step loss (`first_losses` on every rank) is transformers' loss of its
    reference within 1e-5, and the logits the ranks gathered are transformers' (rtol and atol
    1e-5); prints the largest differences, one line per case, under its name."""
    for number, (data, reference, name) in enumerate(zip(cases, references, names, strict=True)):
        want = reference_loss(reference, data)
        sequences = reference_sequences(reference, data)
        loss = ranks[0][number]["loss"]
        worst: float | None = None
        for rank in ranks:
            got = rank[number]["logits"]
            if got is None:
                continue
            want_logits = sequences[rank[number]["dp_rank"]][:, got["positions"]]
            torch.testing.assert_close(
                torch.from_numpy(got["logits"]), want_logits, rtol=1e-5, atol=1e-5
            )
            diff = float((torch.from_numpy(got["logits"]) - want_logits).abs().max())
            worst = diff if worst is None else max(worst, diff)
        shown = "not gathered (PP, FSDP2)" if worst is None else f"{worst:.1e}"
        print(
            f"{name}: |loss - transformers| {abs(loss - want):.1e}, "
            f"max |logits - transformers| {shown}"
        )
        assert abs(loss - want) < 1e-5, (name, loss, want)


def assert_exports_match_one_process(
    tmp_path: Path, source: Path, checkpoints: dict[str, Path], **changes: Any
) -> None:
    """Each checkpoint (named by its layout) exports (`ctxlaunch export --hf`) to the tensors
    of the same step trained in one process from `source` (with `changes`) and exported."""
    from ctxlaunch.cli import app
    from tests.helpers.cli import CliRunner

    runner = CliRunner()
    single = tmp_path / "ckpt-single"
    first_losses(0, 1, [spec_data(source, **changes, **{"training.checkpoint.dir": str(single)})])
    result = runner.invoke(app, ["export", str(single), "--hf", str(tmp_path / "hf-single")])
    assert result.exit_code == 0, result.output
    want_tensors = hf_tensors(tmp_path / "hf-single")
    for number, (layout, checkpoint) in enumerate(checkpoints.items()):
        out = tmp_path / f"hf-export-{number}"
        result = runner.invoke(app, ["export", str(checkpoint), "--hf", str(out)])
        assert result.exit_code == 0, result.output
        got_tensors = hf_tensors(out)
        assert set(got_tensors) == set(want_tensors)
        for name, tensor in want_tensors.items():
            torch.testing.assert_close(
                got_tensors[name],
                tensor,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, n=name, at=layout: f"{at} {n}: {m}",
            )
