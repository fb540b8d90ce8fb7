"""Local (sliding-window) and full layers in the trainer, against transformers' own classes
(test-only references): Gemma 3 (Gemma3ForCausalLM, and the language model of a multimodal
Gemma3ForConditionalGeneration checkpoint), Gemma 2 (soft-capped scores and logits), Mistral
7B v0.1's window on every layer and Qwen2's window layers. config.json read into the model
section; logits, loss and gradients at one process; export in each family's own class; and at
CP 2 and CP 4 (ring zigzag, contiguous, balanced with a document mask, Ulysses, hybrid), TP 2
and PP 2 (a local layer on one stage, a full one on the other) the first step's loss and
logits are transformers' and every gradient is one process's, for windows below a CP chunk,
of a whole shard and spanning two shards.

The reference models are tiny, fp32, random, with random norm gains (tests/helpers/hf_models.py);
the multi-process cases run in one launch per world size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import SpecError, validate_spec
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
    reference_loss,
    reference_sequences,
    save_hf,
    spec_data,
)

runner = CliRunner()
CLASSES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
WINDOWED = {
    # family -> what its tiny config sets for a window of W (the families' own spellings)
    "gemma2": lambda w: {"sliding_window": w},
    "gemma3": lambda w: {"sliding_window": w},
    "mistral": lambda w: {"sliding_window": w},
    "qwen2": lambda w: {"use_sliding_window": True, "sliding_window": w, "max_window_layers": 1},
}


def _reference(directory: Path, family: str, window: int = 5, tied: bool | None = None, **changes):
    config = hf_config(
        "linear",
        family=family,
        tied=family.startswith("gemma") if tied is None else tied,
        **WINDOWED[family](window),
        **changes,
    )
    return save_hf(directory, config)


# -- config.json ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, windows, fields",
    [
        (
            "gemma2",
            (5, None),
            dict(attention_softcap=2.0, logit_softcap=3.0, local_rope_theta=None),
        ),
        (
            "gemma3",
            (5, None),
            dict(attention_softcap=None, logit_softcap=None, local_rope_theta=10000.0),
        ),
        ("mistral", (5, 5), dict(attention_softcap=None, local_rope_theta=None)),
        ("qwen2", (None, 5), dict(attention_softcap=None, local_rope_theta=None)),
    ],
)
def test_config_json_gives_the_local_and_full_layers(family, windows, fields, tmp_path: Path):
    """Each family's config.json becomes its layers' windows, its scale, its soft-caps and the
    local layers' RoPE base; a window shorter than the sequence trains (no refusal)."""
    _reference(tmp_path, family)
    model = validate_spec(spec_data(tmp_path)).model
    assert model.family == family and model.layer_windows == windows
    for name, value in fields.items():
        assert getattr(model, name) == value, name
    if family.startswith("gemma"):
        assert model.query_pre_attn_scalar == 24 and model.tie_embeddings
        assert model.norm_offset and model.post_norms and model.activation == "gelu_tanh"


def test_gemma3_in_transformers_4_spelling_and_its_refusals(tmp_path: Path) -> None:
    """The released files' spelling (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern, keys left at their defaults) reads as transformers 5's; an encoder's
    bidirectional attention and a scaled local RoPE are refused by name."""
    _reference(tmp_path, "gemma3")
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types", "tie_word_embeddings", "hidden_activation"):
        config.pop(key, None)
    config.update(
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_local_base_freq=20000.0,
        sliding_window_pattern=2,
    )
    path.write_text(json.dumps(config))
    model = validate_spec(spec_data(tmp_path)).model
    assert model.layer_windows == (5, None) and model.local_rope_theta == 20000.0
    assert model.rope_theta == 1000000.0 and model.rope_scaling.type == "linear"
    assert model.tie_embeddings and model.activation == "gelu_tanh"
    path.write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(SpecError, match="use_bidirectional_attention is true"):
        validate_spec(spec_data(tmp_path))
    config.pop("rope_scaling")
    config["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    }
    path.write_text(json.dumps(config))
    with pytest.raises(SpecError, match="the local layers' RoPE must be unscaled"):
        validate_spec(spec_data(tmp_path))


def test_layer_types_are_checked() -> None:
    base = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=64)
    assert validate_spec(_job({**base, "layer_types": ["local"]})).model.layer_windows == (
        (None,) * 4
    )
    with pytest.raises(SpecError, match="lists 5 layers, more than layers = 4"):
        validate_spec(_job({**base, "sliding_window": 8, "layer_types": ["full"] * 5}))
    with pytest.raises(SpecError, match="local_rope_theta is set but no layer is local"):
        validate_spec(
            _job({**base, "sliding_window": 8, "layer_types": ["full"], "local_rope_theta": 1e4})
        )
    model = validate_spec(
        _job({**base, "sliding_window": 8, "layer_types": ["local", "local", "full"]})
    ).model
    assert model.layer_windows == (8, 8, None, 8) and model.local_layers == 3


def _job(model: dict) -> dict:
    return {
        "name": "kinds",
        "model": model,
        "training": {"seq_len": 32, "micro_batch": 1, "global_batch": 1, "steps": 1},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }


# -- one process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(CLASSES))
def test_one_process_is_transformers(family: str, tmp_path: Path) -> None:
    """The imported model's logits and first-step loss are transformers' (1e-5: eager and flash
    attention sum in different orders), and the step's gradient reaches every part the family
    adds (the post-norms, the q/k norms, the biases)."""
    reference = _reference(tmp_path, family)
    data = spec_data(tmp_path)
    trainer = build_trainer(0, 1, data)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(tokens).logits
    torch.testing.assert_close(our_logits(trainer, tokens), want, rtol=1e-5, atol=1e-5)
    grads: dict[str, torch.Tensor] = {}
    loss = trainer.train_step(on_gradients=lambda e: grads.update(e.full_gradients())).loss
    assert abs(loss - reference_loss(reference, data)) < 1e-5
    parts = {
        "gemma2": ["blocks.0.attn_post_norm.weight", "blocks.1.ffn_post_norm.weight"],
        "gemma3": ["blocks.0.attn.q_norm.weight", "blocks.1.ffn_post_norm.weight"],
        "qwen2": ["blocks.1.attn.wqkv.bias"],
        "mistral": ["blocks.0.ffn.w_down.weight"],
    }[family]
    for name in parts:
        assert float(grads[name].abs().max()) > 0, name


def test_the_language_model_of_a_multimodal_gemma3_checkpoint(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration: the text model's config under text_config, its tensors
    under language_model.model.; the imported model's text logits are the multimodal class's
    on text alone, and it exports as Gemma3ForCausalLM."""
    import transformers

    text = hf_config("linear", family="gemma3", tied=True)
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        ),
        mm_tokens_per_image=4,
    )  # fmt: skip
    reference = save_hf(tmp_path / "source", config)
    data = spec_data(tmp_path / "source")
    trainer = build_trainer(
        0,
        1,
        {**data, "training": {**data["training"], "checkpoint": {"dir": str(tmp_path / "ckpt")}}},
    )
    assert trainer.spec.model.family == "gemma3"
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(input_ids=tokens).logits
    torch.testing.assert_close(our_logits(trainer, tokens), want, rtol=1e-5, atol=1e-5)
    trainer.save_checkpoint()
    result = runner.invoke(app, ["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["Gemma3ForCausalLM"]
    assert "model.embed_tokens.weight" in hf_tensors(tmp_path / "out")


# -- export ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral"])
def test_export_is_the_familys_own_class(family: str, tmp_path: Path) -> None:
    """Import then export gives every tensor back bit for bit under its own name; after two
    steps at a context-extended RoPE base, from_pretrained of the export is the family's class
    and reproduces the trainer's logits (windows, soft-caps and the local RoPE included)."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    _reference(source, family)
    checkpoints = tmp_path / "ckpt"
    trainer = build_trainer(
        0,
        1,
        spec_data(
            source, **{"training.checkpoint.dir": str(checkpoints), "model.rope_theta": 8000000.0}
        ),
    )
    trainer.save_checkpoint()
    out = tmp_path / "out-0"
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(out)])
    assert result.exit_code == 0, result.output
    want, got = hf_tensors(source), hf_tensors(out)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    trainer.train_step()
    trainer.train_step()
    trainer.save_checkpoint()
    out = tmp_path / "out-2"
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(out)])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(exported).__name__ == CLASSES[family]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want_logits = exported(tokens).logits
    torch.testing.assert_close(our_logits(trainer, tokens), want_logits, rtol=1e-5, atol=1e-5)


# -- layouts -----------------------------------------------------------------------------------
def _corpus(directory: Path) -> str:
    """Documents of 3..20 ids below VOCAB, each ending in 0, as an indexed dataset."""
    from ctxlaunch.runtime.data.indexed import IndexedWriter, token_dtype

    rng = np.random.default_rng(5)
    prefix = directory / "docs"
    with IndexedWriter(prefix, token_dtype(VOCAB)) as writer:
        for _ in range(40):
            writer.add_document(np.append(rng.integers(1, VOCAB, rng.integers(3, 20)), 0))
    return str(prefix)


RING = {"parallel.cp_algorithm": "ring"}
LAYOUTS: dict[int, list[tuple[str, int, dict]]] = {
    # (family, window, layout) at SEQ = 32 tokens: CP 2 shards of 16 (zigzag chunks of 8).
    2: [
        ("gemma3", 5, {"parallel.cp": 2, **RING, "parallel.cp_sharding": "zigzag"}),
        (
            "gemma3",
            24,
            {"parallel.cp": 2, **RING, "parallel.cp_sharding": "balanced", "documents": True},
        ),
        ("gemma3", 5, {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"}),
        ("gemma3", 5, {"parallel.tp": 2}),
        # Untied: the trainer refuses tied embeddings across pipeline stages.
        ("gemma3", 5, {"parallel.pp": 2, "untied": True}),
        ("gemma2", 5, {"parallel.cp": 2, **RING}),
        ("gemma2", 24, {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"}),
        ("mistral", 5, {"parallel.cp": 2, **RING}),
        ("qwen2", 16, {"parallel.cp": 2, **RING, "parallel.cp_sharding": "contiguous"}),
    ],
    # CP 4: shards of 8 (zigzag chunks of 4).
    4: [
        ("gemma3", 5, {"parallel.cp": 4, **RING, "parallel.cp_sharding": "zigzag"}),
        ("gemma3", 16, {"parallel.cp": 4, **RING, "parallel.cp_sharding": "contiguous"}),
        (
            "gemma3",
            24,
            {"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_degree": 2},
        ),
        (
            "gemma2",
            5,
            {"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_degree": 2},
        ),
        ("mistral", 24, {"parallel.cp": 4, **RING}),
    ],
}


def _first_steps(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Per case: this rank's logits of the imported weights, the first step's loss and (rank
    0's) whole gradient."""
    results = []
    for data in cases:
        trainer = build_trainer(rank, world, data)
        logits = local_logits(trainer)
        grads: dict[str, torch.Tensor] = {}
        loss = trainer.train_step(on_gradients=lambda e: grads.update(e.full_gradients())).loss
        results.append(
            {
                "loss": loss,
                "logits": logits,
                "dp_rank": trainer.ctx.dp_rank,
                "grads": {k: v.numpy() for k, v in grads.items()} if rank == 0 else None,
            }
        )
    return results


def _one_process_step(data: dict) -> tuple[float, dict[str, torch.Tensor]]:
    trainer = build_trainer(0, 1, one_process(data))
    grads: dict[str, torch.Tensor] = {}
    loss = trainer.train_step(on_gradients=lambda e: grads.update(e.full_gradients())).loss
    return loss, grads


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts_match_transformers_and_one_process(world: int, tmp_path: Path) -> None:
    """Every case's first-step loss and the logits the ranks hold are transformers' (1e-5);
    every gradient is one process's (rtol 1e-4, and 1e-4 of its largest entry); a
    document-masked case, which
    transformers cannot score packed, is one process's in loss and gradients."""
    corpus = _corpus(tmp_path)
    cases, references = [], []
    for family, window, layout in LAYOUTS[world]:
        source = tmp_path / f"{family}-{window}{'-untied' if layout.get('untied') else ''}"
        if not source.exists():
            _reference(source, family, window, tied=False if layout.get("untied") else None)
        changes = {k: v for k, v in layout.items() if k not in ("documents", "untied")}
        if layout.get("documents"):
            changes |= {
                "training.data.source": "tokens",
                "training.data.path": corpus,
                "training.data.document_mask": True,
            }
        cases.append(spec_data(source, world, **changes))
        references.append(None if layout.get("documents") else _reload(source))
    ranks = run_distributed(_first_steps, world, cases, timeout_s=560)
    for number, (data, reference) in enumerate(zip(cases, references, strict=True)):
        name = f"{LAYOUTS[world][number]}"
        loss, want_grads = _one_process_step(data)
        got = ranks[0][number]
        assert abs(got["loss"] - loss) < 1e-5, (name, got["loss"], loss)
        assert set(got["grads"]) == set(want_grads), name
        worst_grad = max(
            float(
                (torch.from_numpy(got["grads"][n]) - g).abs().max() / g.abs().max().clamp_min(1e-12)
            )
            for n, g in want_grads.items()
        )
        print(f"{name}: |loss - one process| {abs(got['loss'] - loss):.1e}, largest gradient "
              f"difference / that gradient's largest entry {worst_grad:.1e}")  # fmt: skip
        for param, grad in want_grads.items():
            # fp32 sums in another order: within 1e-4 of the gradient's largest entry (a
            # tied, sqrt(hidden)-scaled embedding's gradient sums both ends' contributions).
            torch.testing.assert_close(
                torch.from_numpy(got["grads"][param]), grad, rtol=1e-4,
                atol=1e-4 * float(grad.abs().max()) + 1e-7,
                msg=lambda m, n=param: f"{name} gradient of {n}: {m}",
            )  # fmt: skip
        if reference is None:
            continue
        want_loss = reference_loss(reference, data)
        assert abs(got["loss"] - want_loss) < 1e-5, name
        sequences = reference_sequences(reference, data)
        worst = 0.0
        for rank in ranks:
            held = rank[number]["logits"]
            if held is not None:
                want = sequences[rank[number]["dp_rank"]][:, held["positions"]]
                torch.testing.assert_close(
                    torch.from_numpy(held["logits"]), want, rtol=1e-5, atol=1e-5,
                    msg=lambda m: f"{name} logits: {m}",
                )  # fmt: skip
                worst = max(worst, float((torch.from_numpy(held["logits"]) - want).abs().max()))
        print(f"{name}: |loss - transformers| {abs(got['loss'] - want_loss):.1e}, "
              f"max |logits - transformers| {worst:.1e}")  # fmt: skip


def _reload(source: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source).float().eval()
