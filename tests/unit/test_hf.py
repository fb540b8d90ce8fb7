"""Hugging Face checkpoints in and out, against transformers' own LlamaForCausalLM (a test-only
reference): RoPE scaling tables bit for bit, an imported model's logits and loss at one process
and at TP 2, PP 2, CP 2 (ring, zigzag), TP 2 x PP 2 x CP 2, FSDP2 and DeepSpeed, the spec's
config.json rules, and export (round trip bitwise, from_pretrained reproducing the trainer).

The reference models are tiny, fp32, with random weights and random norm gains (a swapped
mapping of the two norms, or of q and k, shows), saved with save_pretrained to tmp_path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import SpecError, validate_spec
from tests.helpers.cli import CliRunner
from tests.helpers.dist import run_distributed
from tests.helpers.hf_models import (
    ROPES,
    SEQ,
    VOCAB,
    assert_exports_match_one_process,
    assert_layouts_match_transformers,
    build_trainer,
    first_losses,
    hf_config,
    hf_tensors,
    our_logits,
    reference_loss,
    save_hf,
    spec_data,
)

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


# -- RoPE --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_tables_are_transformers_bit_for_bit(rope: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from ctxlaunch.contract.families.hfconfig import rope_from_config
    from ctxlaunch.runtime.modeling.model import rope_tables

    config = hf_config(rope)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.cat([torch.arange(64), torch.arange(1000, 131072, 997)])
    want_cos, want_sin = rotary(torch.zeros(1, 1, 16), positions[None])
    theta, scaling = rope_from_config(json.loads(config.to_json_string()), "test")
    spec = validate_spec(spec_for_shape(rope_theta=theta, rope_scaling=scaling))
    cos, sin = rope_tables(
        positions, 16, spec.model.rope_theta, torch.float32, spec.model.rope_scaling
    )
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


def spec_for_shape(**model) -> dict:
    return {
        "name": "rope",
        "model": {"preset": "tiny", **model},
        "training": {"seq_len": SEQ},
        "cluster": {"gpu": "cpu"},
    }


# -- import at one process -------------------------------------------------------------------
MODELS = {
    "gqa": {},
    "mha": {"kv_heads": 4},
    "tied": {"tied": True},  # Llama 3.2-style
}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_imported_logits_and_loss_match_transformers(rope: str, kind: str, tmp_path: Path) -> None:
    reference = save_hf(tmp_path, hf_config(rope, **MODELS[kind]))
    data = spec_data(tmp_path)
    trainer = build_trainer(0, 1, data)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(tokens).logits
    got = our_logits(trainer, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    loss = trainer.train_step().loss
    assert abs(loss - reference_loss(reference, data)) < 1e-5
    print(f"{kind} {rope}: max |logits - transformers| {float((got - want).abs().max()):.1e}")


def test_llama31_style_model_needs_its_rope_scaling(tmp_path: Path) -> None:
    """The issue's case: a Llama 3.1-style model read with plain RoPE differs from
    transformers by ~1e-2; with its llama3 scaling the logits agree to ~1e-6."""
    reference = save_hf(tmp_path, hf_config("llama3"))
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(tokens).logits
    scaled = our_logits(build_trainer(0, 1, spec_data(tmp_path)), tokens)
    plain = our_logits(
        build_trainer(0, 1, spec_data(tmp_path, **{"model.rope_scaling": "{type: default}"})),
        tokens,
    )
    assert float((scaled - want).abs().max()) < 1e-6
    assert float((plain - want).abs().max()) > 1e-3


def test_each_rank_reads_only_the_rows_it_keeps(tmp_path: Path, monkeypatch) -> None:
    """read_local at every TP rank and FSDP chunk (uneven ones too) returns exactly that rank's
    part of the full weight, and asks safetensors for those rows (and columns) alone."""
    from ctxlaunch.runtime.checkpointing import hf
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.modeling.weight_sharding import chunk_rows, shardings

    save_hf(tmp_path, hf_config("llama3"))
    spec = validate_spec(spec_data(tmp_path))
    with torch.device("meta"):
        model = Transformer.from_spec(spec.model)
    plan = shardings(model)
    checkpoint = hf.SafetensorsCheckpoint(tmp_path)
    whole = {
        name: torch.cat(
            [checkpoint.read(n, (0, checkpoint.shape(n)[0])) for n in hf.hf_names(name, spec.model)]
        )
        for name in plan
    }
    requested: list[int] = []
    read = checkpoint.read

    def counting(name, rows, cols=None):
        piece = read(name, rows, cols)
        requested.append(piece.numel())
        return piece

    monkeypatch.setattr(checkpoint, "read", counting)
    for name, sharding in plan.items():
        shape = whole[name].shape
        for tp in (1, 2, 4):
            for tp_rank in range(tp):
                local = sharding.shard(whole[name], tp, tp_rank) if sharding else whole[name]
                for chunks in (1, 2, 3):
                    for index in range(chunks):
                        rows = chunk_rows(local.shape[0], chunks, index)
                        requested.clear()
                        got = hf.read_local(
                            checkpoint, spec.model, name, shape, sharding, tp, tp_rank, rows
                        )
                        assert torch.equal(got, local[rows[0] : rows[1]]), (
                            name,
                            tp,
                            tp_rank,
                            chunks,
                            index,
                        )
                        assert sum(requested) == got.numel()


# -- the spec's rules --------------------------------------------------------------------------
def test_spec_takes_shape_and_rope_from_config_json(tmp_path: Path) -> None:
    save_hf(tmp_path, hf_config("llama3", tied=True))
    model = validate_spec(spec_data(tmp_path)).model
    assert (
        model.layers,
        model.hidden,
        model.heads,
        model.kv_heads,
        model.ffn_hidden,
        model.vocab,
    ) == (2, 64, 4, 2, 96, VOCAB)
    assert model.tie_embeddings and model.norm_eps == 1e-5 and model.rope_theta == 500000.0
    assert model.rope_scaling.type == "llama3"
    assert model.rope_scaling.original_max_position_embeddings == 16


def test_spec_rope_overrides_config_json(tmp_path: Path) -> None:
    """Extending the context: the spec's rope_theta and rope_scaling win over config.json."""
    save_hf(tmp_path, hf_config("default"))
    model = validate_spec(
        spec_data(
            tmp_path,
            **{
                "model.rope_theta": 1000000.0,
                "model.rope_scaling": "{type: yarn, factor: 4, original_max_position_embeddings: 128}",
            },
        )
    ).model
    assert model.rope_theta == 1e6 and model.rope_scaling.type == "yarn"
    assert model.rope_scaling.factor == 4 and model.rope_scaling.beta_fast == 32


def test_shape_disagreeing_with_config_json_names_field_values_and_file(tmp_path: Path) -> None:
    save_hf(tmp_path, hf_config())
    with pytest.raises(SpecError) as found:
        validate_spec(spec_data(tmp_path, **{"model.hidden": 128}))
    text = str(found.value)
    assert "model.hidden = 128" in text and "64" in text and str(tmp_path / "config.json") in text
    validate_spec(spec_data(tmp_path, **{"model.hidden": 64, "model.kv_heads": 2}))  # agreeing


@pytest.mark.parametrize(
    "change, words",
    [
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM.*GeGLU"),
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "mixture-of-experts"),
        ({"architectures": ["PhiForCausalLM"], "model_type": "phi"}, "partial RoPE"),
        ({"architectures": ["FooForCausalLM"], "model_type": "foo"}, "Qwen3ForCausalLM"),
        ({"model_type": "mistral"}, "mistral"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"head_dim": 15}, "head_dim = 15 must be even"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ],
)
def test_config_json_ctxlaunch_cannot_reproduce_is_refused(
    change: dict, words: str, tmp_path: Path
) -> None:
    save_hf(tmp_path, hf_config())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(SpecError, match=words):
        validate_spec(spec_data(tmp_path))


def test_missing_checkpoint_directory_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no config.json"):
        validate_spec(spec_data(tmp_path / "nowhere"))


def test_a_checkpoint_absent_here_with_the_shape_given_warns_and_the_trainer_refuses(
    tmp_path: Path,
) -> None:
    """A login node renders a job whose checkpoint lives on the cluster: the spec's shape
    stands, validation warns, and the trainer where it runs refuses without config.json."""
    from tests.helpers.trainer_cli import train_once

    shape = {
        "model.layers": 2,
        "model.hidden": 64,
        "model.heads": 4,
        "model.kv_heads": 2,
        "model.ffn_hidden": 128,
        "model.vocab": 256,
    }
    data = spec_data(tmp_path / "on-the-cluster", **shape)
    spec = validate_spec(data)
    assert spec.model.hidden == 64
    assert any("model.init_from" in w and "no config.json" in w for w in spec.warnings())
    done = train_once(data, tmp_path)
    assert done.returncode == 2, done.stderr
    assert "model.init_from" in done.stderr and "no config.json" in done.stderr


def test_sharded_checkpoint_imports(tmp_path: Path) -> None:
    """model.safetensors.index.json and several shards (save_pretrained's max_shard_size)."""
    reference = save_hf(tmp_path, hf_config("yarn"), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(tokens).logits
    torch.testing.assert_close(
        our_logits(build_trainer(0, 1, spec_data(tmp_path)), tokens), want, rtol=1e-5, atol=1e-5
    )


# -- export ------------------------------------------------------------------------------------
runner = CliRunner()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_import_then_export_is_bitwise_identical(
    dtype: torch.dtype, tied: bool, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    save_hf(source, hf_config("llama3", tied=tied), dtype=dtype)
    checkpoints = tmp_path / "ckpt"
    trainer = build_trainer(
        0, 1, spec_data(source, **{"training.checkpoint.dir": str(checkpoints)})
    )
    trainer.save_checkpoint()  # step 0: the imported weights
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["export", str(checkpoints), "--hf", str(out), "--shard-size-mib", "1"]
    )
    assert result.exit_code == 0, result.output
    want, got = hf_tensors(source), hf_tensors(out)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    assert (out / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert config["tie_word_embeddings"] is tied


def test_export_after_training_reproduces_trainer_logits(tmp_path: Path) -> None:
    """Train two steps with a context-extended RoPE, export; from_pretrained gives the
    trainer's logits, with the RoPE it was trained with."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    save_hf(source, hf_config("default"))
    checkpoints = tmp_path / "ckpt"
    trainer = build_trainer(
        0,
        1,
        spec_data(
            source,
            **{
                "training.checkpoint.dir": str(checkpoints),
                "model.rope_theta": 1000000.0,
                "model.rope_scaling": "{type: yarn, factor: 2, original_max_position_embeddings: 16}",
            },
        ),
    )
    trainer.train_step()
    trainer.train_step()
    trainer.save_checkpoint()
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(checkpoints / "step-00000002"), "--hf", str(out)])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert exported.config.rope_parameters["rope_type"] == "yarn"
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = exported(tokens).logits
    torch.testing.assert_close(our_logits(trainer, tokens), want, rtol=1e-5, atol=1e-5)


def test_export_refuses_and_leaves_nothing(tmp_path: Path) -> None:
    save_hf(tmp_path / "source", hf_config())
    checkpoints = tmp_path / "ckpt"
    build_trainer(
        0, 1, spec_data(tmp_path / "source", **{"training.checkpoint.dir": str(checkpoints)})
    ).save_checkpoint()
    (tmp_path / "taken").mkdir()
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(tmp_path / "taken")])
    assert result.exit_code == 2 and "already exists" in result.output
    result = runner.invoke(app, ["export", str(tmp_path / "source"), "--hf", str(tmp_path / "x")])
    assert result.exit_code == 2 and "neither a committed checkpoint" in result.output
    # A spec whose model is not the checkpoint's: refused before anything is written.
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps(
            {
                "name": "other",
                "model": "tiny",
                "training": {"seq_len": 32},
                "cluster": {"gpu": "cpu"},
            }
        )
    )
    result = runner.invoke(
        app, ["export", str(checkpoints), "--hf", str(tmp_path / "y"), "--spec", str(spec)]
    )
    assert result.exit_code == 2 and "does not hold the model" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "source", "spec.yaml", "taken"]


# -- import and export at multi-process layouts ------------------------------------------------
LAYOUTS: dict[int, list[dict]] = {
    2: [
        {"parallel.tp": 2},
        {"parallel.pp": 2},
        {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "zigzag"},
        # Global positions under CP with the other scalings.
        {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "rope": "yarn"},
        {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "rope": "default"},
        # FSDP2 ZeRO-2 at DP 2 (each rank reads only its row chunk), checkpointed.
        {"training.zero_stage": 2, "training.engine": "fsdp2", "export": True},
        # DeepSpeed ZeRO-1 at DP 2 (TP 1 x PP 1), checkpointed in DeepSpeed's format.
        {"training.zero_stage": 1, "training.engine": "deepspeed", "export": True},
    ],
    8: [
        {"parallel.tp": 2, "parallel.pp": 2, "parallel.cp": 2, "export": True},
        {"parallel.tp": 2, "parallel.cp": 4, "parallel.cp_algorithm": "ring", "rope": "yarn"},
    ],
}


def _layout_id(world: int) -> str:
    return f"world{world}"


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(LAYOUTS), ids=_layout_id)
def test_layouts_load_the_imported_weights(world: int, tmp_path: Path) -> None:
    """At TP 2, PP 2, CP 2 (ring, zigzag; llama3, YaRN and plain RoPE), FSDP2 ZeRO-2,
    DeepSpeed ZeRO-1, TP 2 x PP 2 x CP 2 and TP 2 x CP 4 the first step's loss is transformers'
    loss of the checkpoint (GQA), and the logits the ranks can gather are transformers'; the
    checkpoints those runs save export to the weights one process trains to."""
    sources: dict[str, tuple[Path, LlamaForCausalLM]] = {}
    cases, exports = [], []
    for number, layout in enumerate(LAYOUTS[world]):
        rope = layout.get("rope", "llama3")
        if rope not in sources:
            sources[rope] = (
                tmp_path / f"source-{rope}",
                save_hf(tmp_path / f"source-{rope}", hf_config(rope)),
            )
        changes = {k: v for k, v in layout.items() if k not in ("export", "rope")}
        if layout.get("export"):
            changes["training.checkpoint.dir"] = str(tmp_path / f"ckpt-{number}")
            exports.append(number)
        cases.append(spec_data(sources[rope][0], world, **changes))
    ranks = run_distributed(first_losses, world, cases, timeout_s=540)
    references = [sources[layout.get("rope", "llama3")][1] for layout in LAYOUTS[world]]
    names = [f"world {world} {layout}" for layout in LAYOUTS[world]]
    assert_layouts_match_transformers(ranks, cases, references, names)
    # Every exported layout is a llama3 one: the one-process run of the same step, exported,
    # is what each must hold.
    assert_exports_match_one_process(
        tmp_path,
        sources["llama3"][0],
        {str(LAYOUTS[world][n]): tmp_path / f"ckpt-{n}" for n in exports},
    )


def test_export_without_the_init_from_directory(tmp_path: Path) -> None:
    """The source directory moved away after training: the stored model section stands on its
    own; the export is fp32 (the saved weights') and has no tokenizer files to copy."""
    source = tmp_path / "source"
    save_hf(source, hf_config("llama3"), dtype=torch.bfloat16)
    checkpoints = tmp_path / "ckpt"
    build_trainer(
        0, 1, spec_data(source, **{"training.checkpoint.dir": str(checkpoints)})
    ).save_checkpoint()
    source.rename(tmp_path / "moved")
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["rope_scaling"]["rope_type"] == "llama3"
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    got, want = hf_tensors(tmp_path / "out"), hf_tensors(tmp_path / "moved")
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.float()), name  # bf16 widened exactly


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_packed_documents_under_a_mask_score_what_transformers_scores_each_alone(
    tmp_path: Path, rope: str
) -> None:
    """Three documents packed in one sequence, document-masked with restarted positions: each
    token's loss through init_from equals transformers' loss of its document run alone, and
    the packed mean (the targets that open the next document not counted) equals their
    token-weighted mean."""
    from ctxlaunch.runtime.data.batches import masked_micro_batch

    reference = save_hf(tmp_path, hf_config(rope))
    generator = torch.Generator().manual_seed(11)
    lengths = (7, 12, SEQ + 1 - 19)
    docs = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    sequence = torch.cat(docs)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    batch = masked_micro_batch([sequence], [ids], torch.arange(SEQ), restart_positions=True)
    model = build_trainer(0, 1, spec_data(tmp_path)).engine.parts.model
    with torch.no_grad():
        ours, _ = model(batch.tokens, batch.positions, batch.targets, batch.documents, scores=True)
    with torch.no_grad():
        want = torch.cat(
            [
                F.cross_entropy(reference(doc[None, :-1]).logits[0], doc[1:], reduction="none")
                for doc in docs
            ]
        )
    # The last token of each of the first two documents would predict the next one's first
    # token: not counted; every other target is its own document's.
    mine = ours[batch.targets[0] != -100]
    assert mine.numel() == want.numel() == SEQ - 2
    torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)
    assert float(mine.mean()) == pytest.approx(float(want.mean()), rel=1e-5)
