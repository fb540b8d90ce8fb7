"""GPT-OSS (`gpt_oss`), against transformers' own GptOssForCausalLM (a test-only reference): its
config.json read into the model section (windows, YaRN, experts, the clamped SwiGLU), a
quantized checkpoint refused, the presets' parameter counts; at one process the logits, the
language-model and load-balancing losses and every gradient of a step (q/k/v/o biases, sinks,
the router's bias and its softmax over the top-k logits, the experts' biases, the clamped
SwiGLU, the stacked and interleaved experts' import); export (import then export bitwise, and
from_pretrained of a trained export reproducing the trainer's logits); the experts' grouped-GEMM
path with biases against their loop; and, in one two-rank
launch, CP 2 ring x EP 2 and CP 2 Ulysses: the logits are transformers' and the losses and
every gradient one process's, with a window (5) smaller than a CP shard (16).

The reference model is tiny, fp32, random, with random norm gains and biases, two layers (a
local one, then a full one), 4 experts top-2 (tests/helpers/hf_models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import SpecError, validate_spec
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.flops import count_params, flops_per_token
from tests.helpers.cli import CliRunner
from tests.helpers.dist import run_distributed
from tests.helpers.hf_models import (
    SEQ,
    VOCAB,
    build_trainer,
    hf_config,
    hf_tensors,
    local_logits,
    one_process,
    our_logits,
    reference_sequences,
    save_hf,
    spec_data,
)
from tests.helpers.moe_reference import transformers_step
from tests.helpers.trainer_steps import assert_matches_one_process, train_steps

runner = CliRunner()


def _reference(directory: Path):  # type: ignore[no-untyped-def]
    # YaRN stretching 16 positions 4 times: max_position_embeddings says the same, so
    # transformers does not warn of a mismatch.
    return save_hf(directory, hf_config("yarn", family="gpt_oss", max_position_embeddings=64))


@pytest.mark.parametrize(
    "preset, total, active",
    [
        # The model card (openai/gpt-oss-20b and -120b): 20.91B and 116.83B parameters, 3.61B
        # and 5.13B active per token, counting the unembedding but not the embedding.
        ("gpt-oss-20b", 20.91e9, 3.61e9),
        ("gpt-oss-120b", 116.83e9, 5.13e9),
    ],
)
def test_presets_count_the_published_parameters(preset: str, total: float, active: float) -> None:
    counts = count_params(ModelSpec.model_validate({"preset": preset}))
    assert counts.total == pytest.approx(total, rel=0.005)
    assert counts.active - counts.embedding == pytest.approx(active, rel=0.005)


GPT_OSS_20B_128K = {
    "name": "gpt-oss-20b-128k",
    "model": {"preset": "gpt-oss-20b", "dtype": "bf16"},
    "training": {
        "seq_len": 131072,
        "global_batch": 8,
        "activation_checkpointing": "full",
        "zero_stage": 3,
        "engine": "fsdp2",
    },
    "parallel": {"cp": 8, "ep": 8},
    "cluster": {"target": "slurm", "nodes": 1, "gpus_per_node": 8, "gpu": "H100"},
}
"""gpt-oss-20b at 128K tokens on one node of 8 H100, CP 8 with the experts over the same 8."""


def test_validate_plan_and_advise_take_a_gpt_oss_20b_spec() -> None:
    """The spec validates; plan counts the biases and sinks among the parameters (the model
    card's 3.61B in a token's matmuls), the local layers' windows in the FLOPs, fits at CP 8
    and reaches 128K there; advise ranks layouts whose EP degree divides the 32 experts."""
    from ctxlaunch.planning.advise import advise
    from ctxlaunch.planning.plan import plan_job

    spec = validate_spec(GPT_OSS_20B_128K)
    report = plan_job(spec)
    assert report.fits and report.experts is not None
    assert report.flops["params_active"] == report.experts["params_active"]
    at_cp8 = next(o for o in report.cp_options if o.dims.cp == 8)
    assert at_cp8.longest_seq_len >= 131072
    counts = count_params(spec.model)
    assert counts.matmul == pytest.approx(3.61e9, rel=0.005)
    full = spec.model.model_copy(update={"sliding_window": None})
    window = flops_per_token(spec.model, 131072, "full")
    assert report.flops["per_token"]["full"] == window < flops_per_token(full, 131072, "full")
    advice = advise(spec)
    assert advice.ranked
    for candidate in advice.ranked:
        dims = candidate.layout.dims
        assert dims.shard_group % dims.ep == 0 and 32 % dims.ep == 0


def test_config_json_gives_the_model_section_and_quantized_is_refused(tmp_path: Path) -> None:
    """Windows on the local layer, YaRN, every layer sparse with 4 experts top-2 whose
    weights sum to 1, the clamped SwiGLU's constants; an MXFP4 checkpoint (quantization_config)
    and one without attention biases are refused by name."""
    _reference(tmp_path)
    model = validate_spec(spec_data(tmp_path)).model
    assert model.family == "gpt_oss" and model.layer_windows == (5, None)
    assert model.rope_scaling.type == "yarn" and model.attention_sinks
    assert model.qkv_bias and model.o_bias and model.expert_biases and model.router_top_k_first
    moe = model.moe
    assert moe is not None and (moe.experts, moe.experts_per_token, moe.ffn_hidden) == (4, 2, 96)
    assert moe.norm_topk_prob and moe.moe_layers(2) == [0, 1]
    assert (moe.swiglu_limit, moe.swiglu_alpha, moe.aux_loss_coef) == (0.5, 1.702, 0.05)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    # The released files' spelling (transformers 4.x): rope_theta and rope_scaling with YaRN's
    # truncate flag false, no layer_types (every other layer local, from the first).
    released = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    released |= {
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
    }
    path.write_text(json.dumps(released))
    model = validate_spec(spec_data(tmp_path)).model
    assert model.layer_windows == (5, None) and model.rope_theta == 150000
    assert model.rope_scaling.type == "yarn" and model.rope_scaling.truncate is False
    path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(SpecError, match="quantization_config is set.*dequantize=True"):
        validate_spec(spec_data(tmp_path))
    path.write_text(json.dumps({**config, "attention_bias": False}))
    with pytest.raises(SpecError, match="attention_bias is false"):
        validate_spec(spec_data(tmp_path))


def test_logits_losses_and_every_gradient_match_transformers(tmp_path: Path) -> None:
    """Logits of random tokens (1e-5), the first step's language-model and load-balancing
    losses (1e-5) and every gradient (rtol 1e-4, atol 1e-6), the clamps biting."""
    reference = _reference(tmp_path)
    data = spec_data(tmp_path)
    want = transformers_step(reference, data)
    trainer = build_trainer(0, 1, data)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            our_logits(trainer, tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5
        )
        # The limit (0.5) clamps some of the experts' gate and up values at these scores.
        block = reference.model.layers[0]
        normed = block.post_attention_layernorm(reference.model.embed_tokens(tokens))
        gate_up = (
            normed @ block.mlp.experts.gate_up_proj[0] + block.mlp.experts.gate_up_proj_bias[0]
        )
        assert float(gate_up.abs().max()) > 0.5
    grads: dict[str, torch.Tensor] = {}
    step = trainer.train_step(on_gradients=lambda e: grads.update(e.full_gradients()))
    assert abs(step.loss - want["loss"]) < 1e-5
    assert abs(step.aux_loss - want["aux_loss"]) < 1e-5 and step.aux_loss > 0
    assert set(grads) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for name in (
        "blocks.0.ffn.router.bias",
        "blocks.1.ffn.experts.b_gate_up",
        "blocks.0.attn.wo.bias",
    ):
        assert float(grads[name].abs().max()) > 0, name


def test_export_round_trips_and_reproduces_the_trained_logits(tmp_path: Path) -> None:
    """Import then export: every tensor back bit for bit under its own name (the stacked,
    interleaved experts too) and config.json of GptOssForCausalLM; after a step, the export's
    from_pretrained gives the trainer's logits."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    _reference(source)
    checkpoints = tmp_path / "ckpt"
    trainer = build_trainer(
        0, 1, spec_data(source, **{"training.checkpoint.dir": str(checkpoints)})
    )
    trainer.save_checkpoint()
    imported = tmp_path / "imported"
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(imported)])
    assert result.exit_code == 0, result.output
    want, got = hf_tensors(source), hf_tensors(imported)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"] and config["attention_bias"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert (config["swiglu_limit"], config["num_local_experts"]) == (0.5, 4)

    trainer.train_step()
    trainer.save_checkpoint()
    trained = tmp_path / "trained"
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(trained)])
    assert result.exit_code == 0, result.output
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    loaded = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(tokens).logits, our_logits(trainer, tokens), rtol=1e-5, atol=1e-5
        )


LAYOUTS = {
    "CP 2 ring zigzag x EP 2": {"parallel.cp": 2, "parallel.ep": 2},
    "CP 2 Ulysses": {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
}


def _layout_ranks(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case: this rank's logits of the imported weights, then one step's losses and (rank
    0) gradients, as `train_steps` returns them."""
    out = []
    for data in cases:
        trainer = build_trainer(rank, world, data)
        logits = local_logits(trainer)
        grads: dict[str, torch.Tensor] = {}
        step = trainer.train_step(on_gradients=lambda e, g=grads: g.update(e.full_gradients()))
        out.append(
            {
                "logits": logits,
                "losses": [step.loss],
                "aux_losses": [step.aux_loss],
                # numpy: torch would pass tensors through shared memory gone with the worker.
                "grads": {k: v.numpy() for k, v in grads.items()} if rank == 0 else None,
            }
        )
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_cp_ring_with_ep_and_ulysses_match(tmp_path: Path) -> None:
    """In one two-rank launch: the logits each rank holds are transformers' (1e-5), and the
    language-model and load-balancing losses and every gradient equal one process's."""
    reference = _reference(tmp_path)
    cases = [
        validate_spec(spec_data(tmp_path, 2, **layout)).model_dump(mode="json")
        for layout in LAYOUTS.values()
    ]
    ranks = run_distributed(_layout_ranks, 2, cases, timeout_s=540)
    single = train_steps(0, 1, one_process(cases[0]), 1)
    sequences = reference_sequences(reference, cases[0])
    for number, name in enumerate(LAYOUTS):
        for rank in ranks:
            got = rank[number]["logits"]
            want_logits = sequences[0][:, got["positions"]]
            torch.testing.assert_close(
                torch.from_numpy(got["logits"]), want_logits, rtol=1e-5, atol=1e-5, msg=name
            )
        got_steps = ranks[0][number]
        torch.testing.assert_close(
            torch.tensor(got_steps["aux_losses"]),
            torch.tensor(single["aux_losses"]),
            rtol=1e-5,
            atol=1e-7,
        )
        worst = assert_matches_one_process(got_steps, single, name)
        print(f"{name}: max grad diff abs {worst[0]:.1e} rel {worst[1]:.1e}")


def test_grouped_experts_with_biases_equal_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts' grouped-GEMM path (CUDA bf16 in training) adds each row's expert's biases
    as the CPU loop does: torch's grouped_mm runs on the CPU in fp32 here, chosen by patching
    the device check alone; outputs and every gradient equal the loop's (an expert without
    rows among them)."""
    from ctxlaunch.runtime.modeling import moe

    torch.manual_seed(0)
    experts = moe.Experts(4, 16, 8, moe.clamped_swiglu(0.5, 1.702), biases=True)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    rows = torch.randn(10, 16, requires_grad=True)
    weights = torch.randn(10, 16)

    def run() -> dict[str, torch.Tensor]:
        experts.zero_grad()
        rows.grad = None
        out = experts(rows, [3, 0, 5, 2])
        (out * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in experts.named_parameters() if p.grad is not None}
        return {"out": out.detach(), "rows": rows.grad.clone(), **grads}

    loop = run()
    monkeypatch.setattr(moe, "_grouped_mm_usable", lambda _: True)
    grouped = run()
    assert set(grouped) == set(loop) and len(loop) == 6
    for name, value in loop.items():
        torch.testing.assert_close(grouped[name], value, rtol=1e-5, atol=1e-6, msg=name)
