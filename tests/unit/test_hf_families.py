"""Mistral, Qwen2/2.5 and Qwen3 checkpoints in and out, against transformers' own
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (test-only references): the family
read from config.json, an imported model's logits and loss at one process and at every layout
of the Llama tests (TP 2, PP 2, CP 2 ring / Ulysses, CP 4 hybrid, FSDP2, DeepSpeed, and
TP 2 x PP 2 x CP 2 on 8 ranks), documents under a mask scoring what transformers scores each
alone, the sliding-window rule, and export (round trip bitwise, from_pretrained of the export
reproducing the trainer, in the family's own class).

The reference models are tiny, fp32, random, with random norm gains (the q/k norms too) and
random q/k/v biases, saved with save_pretrained to tmp_path (tests/helpers/hf_models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import SpecError, validate_spec
from tests.helpers.cli import CliRunner
from tests.helpers.dist import run_distributed
from tests.helpers.hf_models import (
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

FAMILIES = ("mistral", "qwen2", "qwen3")
CLASSES = {
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
runner = CliRunner()


# -- the spec ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_family_and_head_dim_come_from_config_json(family: str, tmp_path: Path) -> None:
    save_hf(tmp_path, hf_config("default", family=family))
    model = validate_spec(spec_data(tmp_path)).model
    assert model.family == family
    assert model.head_dim == (16 if family == "qwen2" else 32)  # hidden 64 / 4 heads = 16
    assert model.qkv_bias is (family == "qwen2") and model.qk_norm is (family == "qwen3")
    assert model.sliding_window is None


def test_a_family_disagreeing_with_config_json_is_refused(tmp_path: Path) -> None:
    save_hf(tmp_path, hf_config("default", family="qwen3"))
    with pytest.raises(SpecError, match=r"model\.family = 'qwen2' disagrees with 'qwen3'"):
        validate_spec(spec_data(tmp_path, **{"model.family": "qwen2"}))


@pytest.mark.parametrize(
    "family, config, windows",
    [
        # Mistral 7B v0.1: a window on every layer.
        ("mistral", {"sliding_window": 16}, (16, 16)),
        # Qwen2 with the window switched on for the layers from max_window_layers on.
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
            (None, 16),
        ),
        # ... and switched on, but for no layer (max_window_layers = every layer).
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
            (None, None),
        ),
        # The released Qwen checkpoints: a window written, but off.
        ("qwen3", {"use_sliding_window": False, "sliding_window": 16}, (None, None)),
    ],
)
def test_a_sliding_window_shorter_than_the_sequence_makes_local_layers(
    family: str, config: dict, windows: tuple, tmp_path: Path
) -> None:
    """A window that hides keys at the job's length trains as local layers on the layers the
    family's config.json names; `sliding_window: null` in the spec turns it off (full
    attention, as Mistral since v0.2)."""
    save_hf(tmp_path, hf_config("default", family=family, **config))
    model = validate_spec(spec_data(tmp_path)).model  # SEQ = 32 tokens > 16
    assert model.layer_windows == windows
    off = validate_spec(spec_data(tmp_path, **{"model.sliding_window": "null"}))
    assert off.model.sliding_window is None and off.model.layer_windows == (None, None)


# -- the block: what transformers computes, bit for bit where it can be ------------------------
def test_head_norm_is_transformers_bit_for_bit() -> None:
    """Qwen3's q/k norm (one gain of head_dim over each head) as the trainer's RMSNorm computes
    it over (B, S, H, D): the same bits as Qwen3RMSNorm."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from ctxlaunch.runtime.modeling.pointwise import RMSNorm

    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 33, 4, 32, generator=generator)
    gain = 1 + 0.3 * torch.randn(32, generator=generator)
    theirs, ours = Qwen3RMSNorm(32, eps=1e-6), RMSNorm(32, 1e-6)
    with torch.no_grad():
        theirs.weight.copy_(gain)
        ours.weight.copy_(gain)
        assert torch.equal(ours(x), theirs(x))


KINDS = {"gqa": {}, "mha": {"kv_heads": 4}, "tied": {"tied": True}}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_and_loss_match_transformers(
    family: str, kind: str, tmp_path: Path
) -> None:
    """At one process the logits of random tokens are transformers' bit for bit (as the Llama
    path's are), and the first step's loss within the Llama tests' tolerance (1e-5: the
    chunked loss sums in another order); the step's gradient reaches every tensor of the
    family (biases and q/k norms included)."""
    reference = save_hf(tmp_path, hf_config("yarn", family=family, **KINDS[kind]))
    data = spec_data(tmp_path)
    trainer = build_trainer(0, 1, data)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(tokens).logits
    got = our_logits(trainer, tokens)
    assert torch.equal(got, want), float((got - want).abs().max())
    grads: dict[str, torch.Tensor] = {}
    loss = trainer.train_step(on_gradients=lambda e: grads.update(e.full_gradients())).loss
    want_loss = reference_loss(reference, data)
    assert abs(loss - want_loss) < 1e-5
    extra = {
        "qwen2": "blocks.0.attn.wqkv.bias",
        "qwen3": "blocks.0.attn.q_norm.weight",
    }.get(family)
    if extra is not None:
        assert float(grads[extra].abs().max()) > 0, extra
    print(
        f"{family} {kind}: max |logits - transformers| {float((got - want).abs().max()):.1e}, "
        f"|loss - transformers| {abs(loss - want_loss):.1e}"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_under_a_mask_score_what_transformers_scores_each_alone(
    family: str, tmp_path: Path
) -> None:
    """Three documents packed in one sequence, document-masked with restarted positions: each
    token's loss equals transformers' loss of its document run alone."""
    from ctxlaunch.runtime.data.batches import masked_micro_batch

    reference = save_hf(tmp_path, hf_config("default", family=family))
    generator = torch.Generator().manual_seed(11)
    lengths = (7, 12, SEQ + 1 - 19)
    docs = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    batch = masked_micro_batch([torch.cat(docs)], [ids], torch.arange(SEQ), restart_positions=True)
    model = build_trainer(0, 1, spec_data(tmp_path)).engine.parts.model
    with torch.no_grad():
        ours, _ = model(batch.tokens, batch.positions, batch.targets, batch.documents, scores=True)
        want = torch.cat(
            [
                F.cross_entropy(reference(doc[None, :-1]).logits[0], doc[1:], reduction="none")
                for doc in docs
            ]
        )
    mine = ours[batch.targets[0] != -100]
    assert mine.numel() == want.numel() == SEQ - 2
    torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_only_the_rows_it_keeps(family: str, tmp_path: Path, monkeypatch) -> None:
    """read_local at every TP rank and FSDP chunk returns exactly that rank's part of each
    weight (the q/k/v biases split with their output columns, the q/k norms whole), asking
    safetensors for those rows alone."""
    from ctxlaunch.runtime.checkpointing import hf
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.modeling.weight_sharding import chunk_rows, shardings

    save_hf(tmp_path, hf_config("default", family=family))
    spec = validate_spec(spec_data(tmp_path))
    with torch.device("meta"):
        model = Transformer.from_spec(spec.model)
    plan = shardings(model)
    checkpoint = hf.SafetensorsCheckpoint(tmp_path)
    hf.check_shapes(checkpoint, {n: p.shape for n, p in model.named_parameters()}, spec.model)
    whole = {
        name: torch.cat(
            [checkpoint.read(n, (0, checkpoint.shape(n)[0])) for n in hf.hf_names(name, spec.model)]
        )
        for name in plan
    }
    requested: list[int] = []
    read = checkpoint.read

    def counting(name, rows, cols=None):  # type: ignore[no-untyped-def]
        piece = read(name, rows, cols)
        requested.append(piece.numel())
        return piece

    monkeypatch.setattr(checkpoint, "read", counting)
    for name, sharding in plan.items():
        shape = whole[name].shape
        for tp in (1, 2):
            for tp_rank in range(tp):
                local = sharding.shard(whole[name], tp, tp_rank) if sharding else whole[name]
                for chunks in (1, 3):
                    for index in range(chunks):
                        rows = chunk_rows(local.shape[0], chunks, index)
                        requested.clear()
                        got = hf.read_local(
                            checkpoint, spec.model, name, shape, sharding, tp, tp_rank, rows
                        )
                        assert torch.equal(got, local[rows[0] : rows[1]]), (name, tp, tp_rank)
                        assert sum(requested) == got.numel()
    extra = {"qwen2": "attn.wqkv.bias", "qwen3": "attn.q_norm.weight"}.get(family)
    assert extra is None or f"blocks.1.{extra}" in plan


# -- export ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_is_bitwise_identical(
    family: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    """Every tensor back bit for bit, under its own name, and config.json of the family's own
    class with the fields transformers reads (head_dim, the window, the biases' flag)."""
    source = tmp_path / "source"
    save_hf(source, hf_config("llama3", family=family, tied=family == "qwen2"), dtype=dtype)
    checkpoints = tmp_path / "ckpt"
    build_trainer(
        0, 1, spec_data(source, **{"training.checkpoint.dir": str(checkpoints)})
    ).save_checkpoint()
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["export", str(checkpoints), "--hf", str(out), "--shard-size-mib", "1"]
    )
    assert result.exit_code == 0, result.output
    want, got = hf_tensors(source), hf_tensors(out)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[family]] and config["model_type"] == family
    assert config["head_dim"] == (16 if family == "qwen2" else 32)
    if family == "mistral":
        assert config["sliding_window"] is None
    else:
        assert config["use_sliding_window"] is False


@pytest.mark.parametrize("family", FAMILIES)
def test_export_after_training_reproduces_trainer_logits(family: str, tmp_path: Path) -> None:
    """Train two steps with a context-extended RoPE base, export; from_pretrained gives the
    family's class and the trainer's logits."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    save_hf(source, hf_config("default", family=family))
    checkpoints = tmp_path / "ckpt"
    trainer = build_trainer(
        0,
        1,
        spec_data(
            source,
            **{"training.checkpoint.dir": str(checkpoints), "model.rope_theta": 8000000.0},
        ),
    )
    trainer.train_step()
    trainer.train_step()
    trainer.save_checkpoint()
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(out)])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(exported).__name__ == CLASSES[family]
    assert exported.config.rope_parameters["rope_theta"] == 8000000.0
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = exported(tokens).logits
    torch.testing.assert_close(our_logits(trainer, tokens), want, rtol=1e-5, atol=1e-5)


# -- every layout of the Llama tests, for each family --------------------------------------------
LAYOUTS: dict[int, list[dict]] = {
    2: [
        {"parallel.tp": 2},
        {"parallel.pp": 2},
        {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "zigzag"},
        # Ulysses moves heads: the q/k norms run before its all-to-all, on every local head.
        {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
        {"training.zero_stage": 2, "training.engine": "fsdp2", "export": True},
        {"training.zero_stage": 1, "training.engine": "deepspeed", "export": True},
    ],
    4: [
        # Hybrid: Ulysses 2 inside x ring 2 across.
        {"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_degree": 2},
    ],
    8: [
        {"parallel.tp": 2, "parallel.pp": 2, "parallel.cp": 2, "export": True},
    ],
}


ADAM_EPS = {"training.optimizer.eps": 1e-6}
"""The exported layouts compare weights after one AdamW step, whose update is about
lr x g / (|g| + eps): a gradient that is zero in exact arithmetic (the k bias's: adding a
constant to a query's every score changes no softmax) is rounding noise of 1e-9 that eps 1e-8
would turn into a step of a tenth of lr, its sign set by the layout's summation order.
eps 1e-6 keeps such steps below the comparison's tolerance and leaves real gradients' alone."""


def _layout_id(value: object) -> str:
    return f"world{value}" if isinstance(value, int) else str(value)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", sorted(LAYOUTS), ids=_layout_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_load_the_imported_weights(family: str, world: int, tmp_path: Path) -> None:
    """At TP 2, PP 2, CP 2 (ring zigzag, Ulysses), CP 4 hybrid, FSDP2 ZeRO-2, DeepSpeed ZeRO-1
    and TP 2 x PP 2 x CP 2 the first step's loss is transformers' loss of the checkpoint, the
    logits the ranks can gather are transformers', and the checkpoints those runs save export
    to the weights one process trains to."""
    source = tmp_path / "source"
    reference = save_hf(source, hf_config("llama3", family=family))
    cases, exports = [], []
    for number, layout in enumerate(LAYOUTS[world]):
        changes = {**ADAM_EPS, **{k: v for k, v in layout.items() if k != "export"}}
        if layout.get("export"):
            changes["training.checkpoint.dir"] = str(tmp_path / f"ckpt-{number}")
            exports.append(number)
        cases.append(spec_data(source, world, **changes))
    ranks = run_distributed(first_losses, world, cases, timeout_s=840)
    names = [f"{family} world {world} {layout}" for layout in LAYOUTS[world]]
    assert_layouts_match_transformers(ranks, cases, [reference] * len(cases), names)
    if exports:
        assert_exports_match_one_process(
            tmp_path,
            source,
            {str(LAYOUTS[world][n]): tmp_path / f"ckpt-{n}" for n in exports},
            **ADAM_EPS,
        )
