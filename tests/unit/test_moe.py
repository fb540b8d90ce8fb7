"""Mixture-of-experts families in one process, against transformers' own Qwen3MoeForCausalLM,
MixtralForCausalLM and Qwen2MoeForCausalLM (test-only references): the model section read from
config.json, the router, the logits, the language-model and load-balancing losses and every
gradient of a step, export (round trip bitwise, from_pretrained of the export reproducing the
trainer), the capacity's drops, the spec's rules for expert parallelism and the ranks it folds
over DP x CP.

The reference models are tiny, fp32, random, with random norm gains and q/k/v biases, saved with
save_pretrained (tests/helpers/hf_models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ctxlaunch.cli import app
from ctxlaunch.contract.families import FAMILIES
from ctxlaunch.contract.loader import SpecError, validate_spec
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import ModelSpec
from ctxlaunch.perf.flops import count_params
from tests.helpers.cli import CliRunner
from tests.helpers.hf_models import (
    SEQ,
    VOCAB,
    build_trainer,
    hf_config,
    hf_tensors,
    our_logits,
    save_hf,
    spec_data,
)
from tests.helpers.moe_reference import transformers_step
from tests.helpers.paths import ROOT
from tests.helpers.specs import make, problems

FAMILIES_MOE = ("qwen3_moe", "mixtral", "qwen2_moe")
CLASSES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
runner = CliRunner()


# -- the families and their presets --------------------------------------------------------------
@pytest.mark.parametrize(
    "preset, total, active",
    [
        # The model cards: Qwen3-30B-A3B 30.5B total, 3.3B activated; Qwen3-235B-A22B 235B and
        # 22B; Mixtral 8x7B 46.7B and 12.9B; Mixtral 8x22B 141B and 39B.
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("qwen3-235b-a22b", 235e9, 22e9),
        ("mixtral-8x7b", 46.7e9, 12.9e9),
        ("mixtral-8x22b", 141e9, 39e9),
    ],
)
def test_presets_count_the_published_total_and_active_parameters(
    preset: str, total: float, active: float
) -> None:
    counts = count_params(ModelSpec.model_validate({"preset": preset}))
    assert counts.total == pytest.approx(total, rel=0.01)
    assert counts.active == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("family", FAMILIES_MOE)
def test_the_moe_section_comes_from_config_json(family: str, tmp_path: Path) -> None:
    save_hf(tmp_path, hf_config("default", family=family))
    model = validate_spec(spec_data(tmp_path)).model
    assert model.family == family and model.moe is not None
    assert (model.moe.experts, model.moe.experts_per_token) == (4, 2)
    assert model.moe.ffn_hidden == (96 if family == "mixtral" else 32)
    assert model.moe.norm_topk_prob is (family != "qwen2_moe")
    assert model.moe.aux_loss_coef == 0.05
    assert model.moe.shared_ffn_hidden == (48 if family == "qwen2_moe" else None)
    assert model.moe.moe_layers(model.layers) == ([0] if family == "qwen2_moe" else [0, 1])


def test_moe_fields_beside_init_from_must_agree_except_how_to_train(tmp_path: Path) -> None:
    save_hf(tmp_path, hf_config("default", family="qwen3_moe"))
    spec = validate_spec(
        spec_data(tmp_path, **{"model.moe.aux_loss_coef": 0.2, "model.moe.capacity_factor": 2.0})
    )
    assert spec.model.moe is not None and spec.model.moe.aux_loss_coef == 0.2
    assert spec.model.moe.experts == 4
    with pytest.raises(SpecError, match=r"model\.moe\.experts = 8 disagrees with 4"):
        validate_spec(spec_data(tmp_path, **{"model.moe.experts": 8}))


@pytest.mark.parametrize(
    "model_type, lacking",
    [
        ("olmoe", "RMSNorms over the whole q and k projections"),
        ("deepseek_v3", "multi-head latent attention"),
        ("llama4_text", "chunked local attention"),
    ],
)
def test_moe_architectures_still_refused_name_what_is_missing(
    model_type: str, lacking: str, tmp_path: Path
) -> None:
    save_hf(tmp_path, hf_config("default", family="qwen3_moe"))
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type=model_type, architectures=["SomeForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=lacking):
        validate_spec(spec_data(tmp_path))


def test_router_jitter_is_refused(tmp_path: Path) -> None:
    save_hf(tmp_path, hf_config("default", family="mixtral", router_jitter_noise=0.1))
    with pytest.raises(SpecError, match="router_jitter_noise = 0.1"):
        validate_spec(spec_data(tmp_path))


# -- one process against transformers -------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES_MOE)
def test_logits_losses_and_every_gradient_match_transformers(family: str, tmp_path: Path) -> None:
    """Logits of random tokens (1e-5), the first step's language-model and load-balancing
    losses (1e-5) and every gradient of the objective they make (rtol 1e-4, atol 1e-6): the
    router (softmax, top-k, renormalised or not), the experts, the shared expert and its gate,
    the dense layers among the sparse ones."""
    reference = save_hf(tmp_path, hf_config("default", family=family))
    data = spec_data(tmp_path)
    want = transformers_step(reference, data)
    trainer = build_trainer(0, 1, data)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            our_logits(trainer, tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5
        )
    grads: dict[str, torch.Tensor] = {}
    step = trainer.train_step(on_gradients=lambda e: grads.update(e.full_gradients()))
    assert abs(step.loss - want["loss"]) < 1e-5
    assert abs(step.aux_loss - want["aux_loss"]) < 1e-5
    assert set(grads) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    router = "blocks.0.ffn.router.weight"
    assert float(grads[router].abs().max()) > 0
    assert step.expert_load >= 1.0 and len(step.expert_load_layers) == (
        1 if family == "qwen2_moe" else 2
    )
    print(f"{family}: |aux - transformers| {abs(step.aux_loss - want['aux_loss']):.1e}")


def test_the_load_balancing_gradient_is_the_coefficients(tmp_path: Path) -> None:
    """With the coefficient 0 the router's gradient is the language-model loss's alone: the
    difference from the default's is the load-balancing loss's (non-zero)."""
    save_hf(tmp_path, hf_config("default", family="qwen3_moe"))
    router = "blocks.0.ffn.router.weight"
    seen = []
    for coef in (0.05, 0.0):
        grads: dict[str, torch.Tensor] = {}
        trainer = build_trainer(0, 1, spec_data(tmp_path, **{"model.moe.aux_loss_coef": coef}))
        trainer.train_step(on_gradients=lambda e, g=grads: g.update(e.full_gradients()))
        seen.append(grads[router])
    assert float((seen[0] - seen[1]).abs().max()) > 1e-6


def test_a_capacity_drops_the_routings_beyond_it_in_token_order(tmp_path: Path) -> None:
    """capacity_factor c: each expert keeps the first ceil(c x T x k / E) routings of a rank;
    the others' weights are 0 and counted; without one nothing is dropped."""
    from ctxlaunch.runtime.modeling.moe import sort_routings

    save_hf(tmp_path, hf_config("default", family="qwen3_moe"))
    trainer = build_trainer(0, 1, spec_data(tmp_path, **{"model.moe.capacity_factor": 0.5}))
    ffn = trainer.engine.parts.model.blocks[0].ffn
    tokens = torch.randn(SEQ, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, index, weights = ffn.route(tokens)
        kept, dropped = ffn._capacity(index, weights)
    capacity = -(-SEQ * 2 // 2 // 4)  # ceil(0.5 x 32 x 2 / 4)
    _, counts = sort_routings(index, 4)
    assert dropped == int((counts - capacity).clamp_min(0).sum()) > 0
    for expert in range(4):
        rows, slots = (index == expert).nonzero(as_tuple=True)
        assert (kept[rows[:capacity], slots[:capacity]] != 0).all()
        assert (kept[rows[capacity:], slots[capacity:]] == 0).all()
    assert trainer.train_step().tokens_dropped > 0
    assert build_trainer(0, 1, spec_data(tmp_path)).train_step().tokens_dropped == 0


# -- export ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES_MOE)
def test_import_then_export_is_bitwise_identical(family: str, tmp_path: Path) -> None:
    """Every tensor back bit for bit under its own name (each expert's, the router's, the
    shared expert's), and config.json of the family's own class with its expert keys."""
    source = tmp_path / "source"
    save_hf(source, hf_config("llama3", family=family))
    checkpoints = tmp_path / "ckpt"
    build_trainer(
        0, 1, spec_data(source, **{"training.checkpoint.dir": str(checkpoints)})
    ).save_checkpoint()
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(out)])
    assert result.exit_code == 0, result.output
    want, got = hf_tensors(source), hf_tensors(out)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[family]] and config["model_type"] == family
    assert config["num_experts_per_tok"] == 2 and config["router_aux_loss_coef"] == 0.05


@pytest.mark.parametrize("family", FAMILIES_MOE)
def test_export_after_training_reproduces_trainer_logits(family: str, tmp_path: Path) -> None:
    """Two steps, export: from_pretrained gives the family's class and the trainer's logits."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    save_hf(source, hf_config("default", family=family))
    checkpoints = tmp_path / "ckpt"
    trainer = build_trainer(
        0, 1, spec_data(source, **{"training.checkpoint.dir": str(checkpoints)})
    )
    trainer.train_step()
    trainer.train_step()
    trainer.save_checkpoint()
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(checkpoints), "--hf", str(out)])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(exported).__name__ == CLASSES[family]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = exported(tokens).logits
    torch.testing.assert_close(our_logits(trainer, tokens), want, rtol=1e-5, atol=1e-5)


# -- expert parallelism in the spec and the ranks -------------------------------------------------
def test_ep_is_folded_over_dp_and_cp() -> None:
    """ep takes no ranks: the world stays tp x pp x cp x dp; it must divide dp x cp and the
    experts, and a dense model refuses it, each in one sentence."""
    moe = {"model.preset": "qwen3-30b-a3b", "training.seq_len": 32768, "cluster.nodes": 1}
    spec = validate_spec(make(**moe, **{"parallel.cp": 4, "parallel.ep": 8}))
    assert spec.parallel_dims.world_size == 8 and spec.parallel_dims.dp == 2
    found = problems(make(**moe, **{"parallel.cp": 4, "parallel.ep": 16}))
    assert "ep = 16 must divide dp x cp = 2 x 4 = 8" in found["parallel.ep"]
    found = problems(make(**moe, **{"parallel.cp": 8, "parallel.ep": 3}))
    assert "must divide model.moe.experts = 128" in found["parallel.ep"]
    found = problems(make(**{"parallel.ep": 2}))
    assert "model.family llama is dense" in found["parallel.ep"]


def test_deepspeed_takes_ep_at_zero_1_and_2_and_plans_expert_states_over_their_group() -> None:
    """engine deepspeed at ep 2: ZeRO-1 and ZeRO-2 validate; ZeRO-3 and the optimizer's offload
    are refused, each in one sentence naming its field. Planned (bf16 ZeRO-2, DeepSpeed's own
    estimate, 2 + 18/Nd a parameter): the dense states sharded over DP x CP = 8, the experts'
    over the 4 ranks holding the same experts (8 H100, CP 4 x DP 2)."""
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.modelstates import busiest_rank_states, params_per_rank
    from ctxlaunch.perf.modelstates import stage_expert_params as held_experts

    moe = {
        "model.preset": "qwen3-30b-a3b",
        "training.seq_len": 32768,
        "parallel.cp": 4,
        "parallel.ep": 2,
        "training.engine": "deepspeed",
        "cluster.nodes": 1,
    }
    for stage in (1, 2):
        assert validate_spec(make(**moe, **{"training.zero_stage": stage})).state_engine == (
            "deepspeed"
        )
    found = problems(make(**moe, **{"training.zero_stage": 3}))
    assert "ZeRO-1 and ZeRO-2 only" in found["training.zero_stage"]
    found = problems(make(**moe, **{"training.zero_stage": 2, "training.offload.optimizer": True}))
    assert "ep = 2 keeps the optimizer states" in found["training.offload.optimizer"]
    spec = validate_spec(make(**moe, **{"training.zero_stage": 2}))
    layout = Layout.from_spec(spec)
    assert layout.dims.shard_group == 8 and layout.dims.expert_shard_group == 4
    experts = held_experts(spec.model, layout)
    dense = params_per_rank(spec.model, 1, 1, ep=2) - experts
    assert experts == 128 // 2 * 3 * 2048 * 768 * 48
    weights, grads, states = busiest_rank_states(spec.model, layout)
    assert weights == 2 * (dense + experts)
    assert grads == 2 * dense // 8 + 2 * experts // 4
    assert states == 16 * dense // 8 + 16 * experts // 4


def test_ep_groups_are_consecutive_ranks_of_the_shard_group() -> None:
    """TP 2 x CP 2 x DP 2 with ep 4: the shard group of TP index t is ranks t, t+2, t+4, t+6;
    its EP group is all four (each holds a quarter of the experts, nobody shares them); at ep 2
    two EP groups per TP index, and the ranks holding the same experts pair across them."""
    dims = ParallelDims(tp=2, cp=2, dp=2, ep=4)
    groups = dims.group_ranks()
    assert ("ep", [0, 2, 4, 6]) in groups and ("ep", [1, 3, 5, 7]) in groups
    assert not [g for role, g in groups if role == "edp"]
    assert [dims.coordinates(r).ep_rank for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    dims = dims.replace(ep=2)
    ep = [g for role, g in dims.group_ranks() if role == "ep"]
    edp = [g for role, g in dims.group_ranks() if role == "edp"]
    assert ep == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert dims.world_size == 8 and dims.expert_shard_group == 2
    piped = ParallelDims(pp=2, cp=2, ep=2)
    assert ("tokens", [0, 1]) in piped.group_ranks() and ("tokens", [2, 3]) in piped.group_ranks()


def test_every_moe_family_preset_validates_with_expert_parallelism() -> None:
    for family in FAMILIES_MOE:
        for preset in FAMILIES[family].presets:
            model = ModelSpec.model_validate({"preset": preset})
            assert model.moe is not None
            ep = 2 if model.moe.experts % 2 == 0 else 1
            validate_spec(
                make(
                    **{
                        "model.preset": preset,
                        "parallel.cp": 8,
                        "parallel.ep": ep,
                        "training.seq_len": 32768,
                    }
                )
            )


# -- planned before submit ------------------------------------------------------------------------
RECIPE = ROOT / "jobs" / "qwen3-30b-a3b-extend-256k.yaml"


def test_plan_counts_the_experts_and_reaches_256k_on_one_h100_node() -> None:
    """The recipe: total and active parameters, the experts a rank holds and their states,
    the routing load admitted and the buffers at it, the all-to-all inside the node; it fits
    at 256K tokens on 8 x H100 80 GB, and the longest sequence at CP 8 is at least that."""
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.planning.plan import plan_job

    report = plan_job(load_spec(RECIPE))
    experts = report.experts
    assert experts is not None and report.fits
    assert experts["params_active"] < experts["params_total"] / 8
    assert experts["expert_params_per_rank"] == 128 // 8 * 3 * 2048 * 768 * 48
    assert experts["routed_load"] == 1.5
    assert experts["all_to_all_bytes_per_step_in_node"] > 0
    assert experts["all_to_all_bytes_per_step_across_nodes"] == 0
    assert report.flops["params_active"] == experts["params_active"]
    at_cp8 = next(o for o in report.cp_options if o.dims.cp == 8)
    assert at_cp8.dims.ep == 8 and at_cp8.longest_seq_len >= 262144


def test_the_planner_admits_the_worst_dropless_routing_unless_told() -> None:
    """Without planned_load the busiest EP rank is planned to receive every routing of its
    group (ep times its share); a capacity bounds it; one EP rank needs no more than its own."""
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.moecost import routed_load

    model = ModelSpec.model_validate({"preset": "qwen3-30b-a3b"})
    layout = Layout(seq_len=65536).with_dims(cp=8, ep=8)
    assert routed_load(model, layout) == 8
    capped = model.model_copy(
        update={"moe": model.moe.model_copy(update={"capacity_factor": 1.25})}
    )
    assert routed_load(capped, layout) == 1.25
    assert routed_load(model, layout.with_dims(ep=1)) == 1


def test_advise_ranks_the_ep_degree_with_the_rest() -> None:
    """advise varies EP over the degrees that divide dp x cp and the experts, beside CP, TP,
    PP and ZeRO; each ranked layout's EP degree divides its DP x CP ranks."""
    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.planning.advise import advise

    advice = advise(load_spec(RECIPE))
    degrees = {c.layout.dims.ep for c in advice.ranked}
    assert len(degrees) > 1
    for candidate in advice.ranked:
        dims = candidate.layout.dims
        assert dims.shard_group % dims.ep == 0 and 128 % dims.ep == 0
