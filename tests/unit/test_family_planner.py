"""The planner's view of each family: parameter counts against transformers' own models of the
released shapes (built on the meta device, from the config.json ctxlaunch's export writes),
FLOPs in both MFU conventions by hand where head_dim is free of hidden / heads, and the
activation bytes per token against what autograd really saves for the trainer's block
(saved-tensor hooks). The peak against the allocator's record is in test_memory_peak.py."""

from __future__ import annotations

import pytest
import torch

from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.flops import count_params, flops_per_token
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.memory import activation_bytes, block_activation_bytes_per_token
from ctxlaunch.runtime.modeling.model import Transformer
from devkit.memtrace import SavedTensorMeter

PRESETS = ("llama3-8b", "mistral-7b", "mistral-nemo-12b", "qwen2.5-7b", "qwen2.5-7b-1m", "qwen3-8b")


@pytest.mark.parametrize("preset", PRESETS)
def test_parameter_counts_equal_transformers(preset: str) -> None:
    """count_params of the preset equals the parameters of transformers' own class built from
    the config.json export writes for it (on the meta device: no memory), and the trainer's
    model of the same spec."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ctxlaunch.runtime.checkpointing.hf import hf_config

    model = ModelSpec.model_validate({"preset": preset})
    config = hf_config(model, dtype=torch.bfloat16, max_positions=32768)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        ours = Transformer.from_spec(model)
    assert type(theirs).__name__ == config["architectures"][0]
    want = sum(p.numel() for p in theirs.parameters())
    counted = count_params(model).total
    print(f"{preset}: {counted:,} parameters ({type(theirs).__name__}: {want:,})")
    assert counted == want == sum(p.numel() for p in ours.parameters())


def test_flops_follow_the_query_width_not_the_hidden_size() -> None:
    """Mistral NeMo 12B: 32 heads of 128 on a width of 5,120, so the q and o projections are
    5,120 x 4,096 and attention runs over 4,096 wide queries; by hand, at 128K tokens."""
    nemo = ModelSpec.model_validate({"preset": "mistral-nemo-12b"})
    h, q, kv, f, layers, vocab = 5120, 4096, 1024, 14336, 40, 131072
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h
    matmul = layers * per_layer + h + vocab * h  # blocks, final norm, head (embedding a lookup)
    seq = 131072
    full = 6 * matmul + 12 * layers * q * seq
    assert flops_per_token(nemo, seq, "full") == full
    assert flops_per_token(nemo, seq, "causal") == 6 * matmul + 6 * layers * q * seq


@pytest.mark.parametrize(
    "family, head_dim", [("qwen3", 64), ("qwen2", None), ("mistral", 48), ("llama", 48)]
)
@pytest.mark.parametrize(
    "dtype, zero, checkpointing",
    [
        ("fp32", 0, "none"),
        ("fp32", 0, "selective"),
        ("fp32", 0, "full"),
        ("bf16", 0, "none"),  # autocast: fp32 residual and bf16 weight copies
        ("bf16", 2, "none"),
        ("bf16", 2, "selective"),
    ],
)
def test_predicted_activations_equal_saved_tensors(
    family: str, head_dim: int | None, dtype: str, zero: int, checkpointing: str
) -> None:
    """What each family's block saves for backward (the q/k norms' input, the fused q/k/v
    output, and their fp32 reciprocal RMS; nothing for the biases; queries of head_dim x
    heads), byte for byte."""
    model_spec = ModelSpec(
        layers=2,
        hidden=256,
        heads=8,
        kv_heads=2,
        ffn_hidden=704,
        vocab=256,
        family=family,
        head_dim=head_dim,
    )
    torch.manual_seed(0)
    seq = 1024
    model = Transformer.from_spec(model_spec)
    model.set_checkpointing(checkpointing)
    if dtype == "bf16" and zero > 0:
        model = model.to(torch.bfloat16)  # what DeepSpeed does to the module under bf16
    tokens = torch.randint(0, model_spec.vocab, (1, seq))
    targets = torch.randint(0, model_spec.vocab, (1, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16" and zero == 0):
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            loss = model(tokens, torch.arange(seq), targets)
    layout = Layout(
        seq_len=seq, dtype=dtype, zero_stage=zero, activation_checkpointing=checkpointing
    )
    assert activation_bytes(model_spec, layout) == meter.bytes
    loss.backward()  # the graph is sound


def test_the_head_norms_cost_the_fused_projection_output() -> None:
    """Qwen3-8B in bf16 (DeepSpeed), no checkpointing: the q/k norms keep the fused q/k/v
    output (a x (h_q + 2 h_kv)) and the fp32 reciprocal RMS of every head of q and k on top of
    the Llama-shaped block, by hand."""
    qwen3 = ModelSpec.model_validate({"preset": "qwen3-8b"})
    plain = ModelSpec.model_validate({"preset": "qwen3-8b", "family": "llama"})
    layout = Layout(seq_len=32768, dtype="bf16", zero_stage=2)
    extra = block_activation_bytes_per_token(qwen3, layout) - block_activation_bytes_per_token(
        plain, layout
    )
    assert extra == 2 * (4096 + 2 * 1024) + 4 * (32 + 8)
