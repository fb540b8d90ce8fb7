"""The job spec: every validation rule, warnings, presets, overrides and error reporting."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest

from ctxlaunch.contract.families import MODEL_PRESETS
from ctxlaunch.contract.loader import (
    SpecError,
    apply_overrides,
    load_spec,
    parse_yaml,
    validate_spec,
)
from tests.helpers.specs import SPEC, make, problems


def test_base_is_valid_and_derives_dp() -> None:
    spec = validate_spec(SPEC)
    assert (
        spec.parallel_dims.dp == 4
        and spec.parallel_dims.ring_degree == 8
        and spec.parallel_dims.ulysses_degree == 1
    )
    assert spec.model.layers == 32 and spec.model.kv_heads == 8 and spec.model.head_dim == 128


def test_composition_must_equal_gpu_count() -> None:
    found = problems(make(**{"parallel.dp": 3}))
    assert "parallel.dp" in found
    assert "= 24, but nodes x gpus_per_node = 32" in found["parallel.dp"]
    found = problems(make(**{"parallel.cp": 3}))
    assert "must divide the GPU count" in found["parallel"]


def test_tp_must_divide_heads_and_kv_heads() -> None:
    found = problems(
        make(**{"model.heads": 24, "model.hidden": 3072, "parallel.tp": 16, "parallel.cp": 2})
    )
    assert "model.heads = 24 must be divisible by tp = 16" in found["parallel.tp"]
    found = problems(make(**{"parallel.tp": 16, "parallel.cp": 2}))
    assert "kv_heads = 8 must be divisible by tp = 16" in found["parallel.tp"]


def test_ulysses_degree_capped_by_kv_heads_names_hybrid() -> None:
    found = problems(
        make(**{"parallel.cp": 16, "parallel.cp_algorithm": "ulysses", "cluster.nodes": 2})
    )
    message = found["parallel.cp"]
    assert "exceeds the K/V heads per TP rank (8)" in message
    assert "hybrid" in message and "ulysses_degree: 8" in message and "ring degree 2" in message


def test_ulysses_degree_must_divide_heads() -> None:
    found = problems(
        make(
            **{
                "model.preset": "tiny-mha",
                "model.heads": 6,
                "model.kv_heads": 6,
                "model.hidden": 192,
                "parallel.cp": 4,
                "parallel.cp_algorithm": "ulysses",
                "cluster.nodes": 1,
                "cluster.gpus_per_node": 4,
                "training.seq_len": 1024,
            }
        )
    )
    assert "must divide the query heads" in found["parallel.cp"]


def test_ulysses_within_kv_heads_is_valid() -> None:
    spec = validate_spec(make(**{"parallel.cp_algorithm": "ulysses"}))
    assert spec.parallel_dims.ulysses_degree == 8 and spec.parallel_dims.ring_degree == 1


@pytest.mark.parametrize(
    "layout, seq, ok",
    [
        ("zigzag", 131072, True),
        ("zigzag", 131072 + 8, False),
        ("zigzag", 131072 + 16, True),
        ("contiguous", 131072 + 8, True),
        ("contiguous", 131072 + 4, False),
    ],
)
def test_sequence_divisibility(layout: str, seq: int, ok: bool) -> None:
    data = make(**{"parallel.cp_sharding": layout, "training.seq_len": seq})
    if ok:
        validate_spec(data)
        return
    message = problems(data)["training.seq_len"]
    rule = "2 x cp = 16" if layout == "zigzag" else "divisible by cp"
    assert rule in message and "fix: seq_len =" in message


def test_hybrid_degrees_multiply_to_cp() -> None:
    spec = validate_spec(
        make(
            **{
                "parallel.cp": 16,
                "parallel.cp_algorithm": "hybrid",
                "parallel.ulysses_degree": 8,
                "cluster.nodes": 2,
            }
        )
    )
    assert spec.parallel_dims.ulysses_degree == 8 and spec.parallel_dims.ring_degree == 2
    found = problems(
        make(
            **{
                "parallel.cp": 16,
                "parallel.cp_algorithm": "hybrid",
                "parallel.ulysses_degree": 8,
                "parallel.ring_degree": 4,
                "cluster.nodes": 2,
            }
        )
    )
    assert "8 x 4 = 32, but cp = 16" in found["parallel.ring_degree"]
    found = problems(
        make(**{"parallel.cp": 8, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_degree": 3})
    )
    assert "must divide cp = 8" in found["parallel.ulysses_degree"]
    found = problems(make(**{"parallel.cp": 8, "parallel.cp_algorithm": "hybrid"}))
    assert "needs ulysses_degree" in found["parallel.ulysses_degree"]
    found = problems(make(**{"parallel.ulysses_degree": 2}))
    assert "applies to cp_algorithm hybrid only" in found["parallel.ulysses_degree"]


def test_hybrid_inner_degree_is_still_capped_by_kv_heads() -> None:
    found = problems(
        make(
            **{
                "parallel.cp": 16,
                "parallel.cp_algorithm": "hybrid",
                "parallel.ulysses_degree": 16,
                "cluster.nodes": 2,
            }
        )
    )
    assert "exceeds the K/V heads" in found["parallel.ulysses_degree"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "My_Job"),
        ("name", "job-"),
        ("name", "a" * 49),
        ("cluster.kubernetes.namespace", "Team.A"),
        ("cluster.kubernetes.service_account", "Bad_Name"),
        ("cluster.kubernetes.image_pull_secrets", "[UPPER]"),
    ],
)
def test_kubernetes_names_follow_rfc1123(field: str, value: str) -> None:
    found = problems(make(**{field: value}))
    assert any(path.startswith(field) for path in found), found


@pytest.mark.parametrize("name", ["_", "PWD", "SHLVL", "BASH_ENV"])
def test_the_shells_own_variables_are_refused_as_environment(name: str) -> None:
    """bash sets these itself in the batch script (an export would not hold: a property test
    found `_`) or reads them at start-up (BASH_ENV: a file it sources)."""
    found = problems(make(**{f"fabric.env.{name}": '"x"'}))
    assert "is the shell's own" in found.get("fabric.env", ""), found
    assert validate_spec(make(**{"fabric.env.MY_SETTING": '"x"'})).fabric.env == {"MY_SETTING": "x"}


def test_unknown_fields_are_errors_with_a_suggestion() -> None:
    data = make()
    data["training"]["sequence_length"] = 4096
    data["parallell"] = {}
    found = problems(data)
    assert "did you mean 'seq_len'" in found["training.sequence_length"]
    assert "did you mean 'parallel'" in found["parallell"]


def test_every_field_problem_is_reported_at_once() -> None:
    data = make(
        **{
            "training.micro_batch": 0,
            "cluster.gpu": "X100",
            "model.layers": "many",
            "cluster.slurm.time_limit": "forever",
            "cluster.slurm.partition": "a b",
        }
    )
    found = problems(data)
    assert {
        "training.micro_batch",
        "cluster.gpu",
        "model.layers",
        "cluster.slurm.time_limit",
        "cluster.slurm.partition",
    } <= set(found)


def test_layout_problems_are_reported_together() -> None:
    found = problems(
        make(
            **{
                "parallel.cp": 16,
                "parallel.cp_algorithm": "ulysses",
                "cluster.nodes": 2,
                "training.seq_len": 1000,
                "cluster.target": "local",
            }
        )
    )
    assert {"parallel.cp", "training.seq_len", "cluster.nodes"} <= set(found)


def test_batch_arithmetic() -> None:
    spec = validate_spec(make(**{"training.global_batch": 16}))
    assert spec.grad_accum == 4 and spec.global_batch == 16
    assert (
        "multiple of micro_batch x dp"
        in problems(make(**{"training.global_batch": 6}))["training.global_batch"]
    )
    found = problems(make(**{"training.global_batch": 16, "training.grad_accum": 2}))
    assert "disagrees" in found["training.grad_accum"]


def test_targets() -> None:
    assert "nodes must be 1" in problems(make(**{"cluster.target": "local"}))["cluster.nodes"]
    found = problems(make(**{"cluster.target": "kubernetes"}))
    assert "needs an image" in found["cluster.kubernetes.image"]


def test_model_shape_rules() -> None:
    found = problems(make(**{"model.kv_heads": 5}))
    assert "divisible by kv_heads = 5" in found["model.kv_heads"]
    assert "unknown model preset 'llama9'" in problems(make(**{"model.preset": "llama9"}))["model"]


def test_push_telemetry_needs_a_url() -> None:
    found = problems(make(**{"telemetry.prometheus": "push"}))
    assert "pushgateway_url" in found["telemetry.pushgateway_url"]


def test_text_data_needs_a_path_and_a_byte_vocab() -> None:
    found = problems(make(**{"training.data.source": "text"}))
    assert "needs data.path" in found["training.data.path"]
    found = problems(
        make(**{"training.data.source": "text", "training.data.path": "x.txt", "model.vocab": 100})
    )
    assert "vocab >= 256" in found["model.vocab"]


def test_warning_pcie_only_gpu() -> None:
    spec = validate_spec(make(**{"cluster.gpu": "L40S"}))
    assert any("PCIe-only" in w for w in spec.warnings())


def test_warning_ring_wider_than_a_node_suggests_hybrid() -> None:
    spec = validate_spec(make(**{"parallel.cp": 16, "cluster.nodes": 2}))
    warnings = spec.warnings()
    assert any("wider than a node" in w and "ulysses_degree: 8" in w for w in warnings)
    assert any("spans beyond the NVLink domain" in w for w in warnings)
    assert validate_spec(SPEC).warnings() == []


def test_presets_are_real_shapes_and_overridable() -> None:
    for name in MODEL_PRESETS:
        validate_spec(make(**{"model.preset": name, "training.seq_len": 4096}))
    spec = validate_spec(make(**{"model.layers": 2}))
    assert spec.model.layers == 2 and spec.model.hidden == 4096
    shorthand = copy.deepcopy(SPEC)
    shorthand["model"] = "llama3-70b"
    assert validate_spec(shorthand).model.layers == 80


def test_overrides_parse_yaml_values() -> None:
    data = apply_overrides(
        SPEC,
        [
            "parallel.cp=4",
            "cluster.slurm.requeue=false",
            "fabric.hcas=[mlx5_0, mlx5_1]",
            "name=other",
        ],
    )
    assert data["parallel"]["cp"] == 4 and data["cluster"]["slurm"]["requeue"] is False
    assert data["fabric"]["hcas"] == ["mlx5_0", "mlx5_1"] and data["name"] == "other"
    assert SPEC["parallel"]["cp"] == 8  # the input is not modified
    with pytest.raises(SpecError, match="expected path.to.field=value"):
        apply_overrides(SPEC, ["parallel.cp"])
    with pytest.raises(SpecError, match="is not a mapping"):
        apply_overrides(SPEC, ["name.first=x"])


def test_yaml_errors_name_the_line() -> None:
    with pytest.raises(SpecError, match="line 2, column"):
        parse_yaml("name: x\nmodel: a: b\n", "bad.yaml")
    with pytest.raises(SpecError, match="must be a YAML mapping"):
        parse_yaml("- a\n- b\n", "list.yaml")


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read the spec: No such file"):
        load_spec(tmp_path / "absent.yaml")


def test_json_schema_is_complete() -> None:
    from ctxlaunch.contract.spec import json_schema

    schema = json_schema()
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"name", "model", "training"}
    parallel = schema["$defs"]["ParallelSpec"]["properties"]
    assert parallel["cp_algorithm"]["enum"] == ["ring", "ulysses", "hybrid"]
    assert "description" in parallel["cp_sharding"]


def test_json_schema_describes_every_field_by_its_docstring() -> None:
    """The models are built without pydantic's use_attribute_docstrings (it read the source at
    import, a fifth of the module's import time); json_schema() reads the docstrings instead,
    and must say for each field exactly what pydantic's own extraction finds."""
    from pydantic._internal._docs_extraction import extract_docstrings_from_cls

    from ctxlaunch.contract import spec as spec_module
    from ctxlaunch.contract.spec.fields import _Strict

    schema = spec_module.json_schema()
    models = [
        m
        for m in vars(spec_module).values()
        if isinstance(m, type) and issubclass(m, _Strict) and m.__name__ in schema["$defs"]
    ]
    assert len(models) >= 15
    described = 0
    for model in models:
        properties = schema["$defs"][model.__name__]["properties"]
        for name, info in model.model_fields.items():
            owner = next(k for k in model.__mro__ if name in k.__dict__.get("__annotations__", {}))
            expected = extract_docstrings_from_cls(owner, use_inspect=True).get(name)
            shown = properties[info.alias or name].get("description")
            if model.__name__ == "ModelSpec" and name == "preset":
                continue  # json_schema() writes this one itself, from the same docstring
            assert shown == expected, (model.__name__, name)
            described += expected is not None
    assert described > 100, described


def test_slurm_times_are_not_read_as_base_60_numbers() -> None:
    # YAML 1.1 would read 10:00 as 600; a Slurm time limit must stay what the user wrote.
    spec = validate_spec(apply_overrides(SPEC, ["cluster.slurm.time_limit=10:00"]))
    assert spec.cluster.slurm.time_limit == "10:00"
    data = parse_yaml("name: x\ncluster:\n  slurm:\n    time_limit: 1:30:00\n", "t.yaml")
    assert data["cluster"]["slurm"]["time_limit"] == "1:30:00"
    assert parse_yaml("a: 3e-4\nb: 12\n", "n.yaml") == {"a": 3e-4, "b": 12}


def test_uneven_pipeline_stages_are_legal_and_balanced_counting_embedding_and_head() -> None:
    """Llama 3 405B's 126 layers at PP 16: lighter first and last stages."""
    spec = validate_spec(
        make(
            **{
                "model.preset": "llama3-405b",
                "parallel.pp": 16,
                "parallel.cp": 1,
                "parallel.tp": 2,
                "cluster.nodes": 4,
                "training.grad_accum": 16,
            }
        )
    )
    assert spec.stage_layers == (7,) + (8,) * 14 + (7,)
    even = validate_spec(
        make(
            **{
                "model.preset": "llama3-70b",
                "parallel.pp": 8,
                "parallel.cp": 4,
                "training.grad_accum": 8,
            }
        )
    )
    assert even.stage_layers == (10,) * 8
    given = validate_spec(
        make(
            **{
                "parallel.pp": 4,
                "parallel.cp": 2,
                "training.grad_accum": 4,
                "parallel.stage_layers": "[6, 10, 10, 6]",
            }
        )
    )
    assert given.stage_layers == (6, 10, 10, 6)


def test_stage_layers_are_checked_against_the_stages_and_the_layers() -> None:
    found = problems(
        make(**{"parallel.pp": 4, "parallel.cp": 2, "parallel.stage_layers": "[8, 8, 8]"})
    )
    assert (
        "3 entries but there are pp x virtual_stages = 4 x 1 = 4" in found["parallel.stage_layers"]
    )
    found = problems(
        make(
            **{
                "parallel.pp": 2,
                "parallel.cp": 2,
                "parallel.virtual_stages": 2,
                "parallel.stage_layers": "[8, 8, 8, 9]",
            }
        )
    )
    assert "sum to 33 but model.layers = 32" in found["parallel.stage_layers"]
    found = problems(
        make(**{"parallel.pp": 2, "parallel.cp": 2, "parallel.stage_layers": "[32, 0]"})
    )
    assert "greater than or equal to 1" in found["parallel.stage_layers[1]"]
    found = problems(make(**{"model.layers": 3, "parallel.pp": 4, "parallel.cp": 2}))
    assert "cannot fill pp x virtual_stages = 4 stages" in found["parallel.pp"]
    found = problems(make(**{"parallel.virtual_stages": 2}))
    assert "needs pp > 1" in found["parallel.virtual_stages"]
    found = problems(
        make(
            **{
                "parallel.pp": 4,
                "parallel.cp": 2,
                "parallel.virtual_stages": 2,
                "training.grad_accum": 6,
            }
        )
    )
    assert "multiple of 4" in found["training.grad_accum"]
    found = problems(make(**{"parallel.pp": 4, "parallel.cp": 2, "training.grad_accum": 3}))
    assert "1F1B needs at least one per stage" in found["training.grad_accum"]
    found = problems(make(**{"model.preset": "llama3.2-1b", "parallel.pp": 2}))
    assert "tie_embeddings" in str(found)


def test_tensor_parallel_splits_ffn_vocab_and_each_cp_ranks_tokens() -> None:
    found = problems(
        make(
            **{"model.ffn_hidden": 14337, "model.vocab": 128257, "parallel.tp": 2, "parallel.cp": 4}
        )
    )
    assert "ffn_hidden = 14337 must be divisible by tp = 2" in found["parallel.tp"]
    assert "vocab = 128257 must be divisible by tp = 2" in found["parallel.tp"]
    found = problems(
        make(
            **{
                "training.seq_len": 131068,
                "parallel.tp": 2,
                "parallel.cp": 4,
                "parallel.cp_sharding": "contiguous",
            }
        )
    )
    assert "divisible by cp x tp = 8" in found["training.seq_len"]


# -- parallel.layout, the old name of parallel.cp_sharding ----------------------------------------
OLD_NAME = "parallel.layout is deprecated: write parallel.cp_sharding (the same values)"


def _with_old_name(value: str) -> dict:
    """SPEC with its sharding given as `parallel.layout` only."""
    data = copy.deepcopy(SPEC)
    parallel = {k: v for k, v in data["parallel"].items() if k != "cp_sharding"}
    data["parallel"] = {**parallel, "layout": value}
    return data


@pytest.mark.parametrize("value", ["zigzag", "contiguous"])
def test_the_old_name_parallel_layout_is_read_as_cp_sharding_and_warns(value: str) -> None:
    """A spec written with `parallel: {layout: ...}` still validates and means cp_sharding; it
    warns, once as a DeprecationWarning and once among the spec's warnings (which `validate`
    prints), and the spec the job carries spells the new name only."""
    with pytest.warns(DeprecationWarning, match=re.escape(OLD_NAME)):
        spec = validate_spec(_with_old_name(value))
    assert spec.parallel.cp_sharding == value
    assert spec.parallel.deprecations == [OLD_NAME]
    assert OLD_NAME in spec.warnings()
    dumped = spec.model_dump()["parallel"]
    assert dumped["cp_sharding"] == value and "layout" not in dumped
    # The new name alone warns of nothing.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="parallel.layout")
        assert OLD_NAME not in validate_spec(make(**{"parallel.cp_sharding": value})).warnings()


def test_the_old_name_set_on_the_command_line_replaces_the_new_one() -> None:
    """`--set parallel.layout=contiguous` on a spec that says cp_sharding: zigzag: the old name
    wins, as any --set does, and still warns."""
    data = apply_overrides(
        make(**{"parallel.cp_sharding": "zigzag"}), ["parallel.layout=contiguous"]
    )
    with pytest.warns(DeprecationWarning, match=re.escape(OLD_NAME)):
        spec = validate_spec(data)
    assert spec.parallel.cp_sharding == "contiguous"


def test_the_old_and_the_new_name_must_agree() -> None:
    data = _with_old_name("contiguous")
    data["parallel"]["cp_sharding"] = "zigzag"
    found = problems(data)
    assert (
        "parallel.layout (the old name of parallel.cp_sharding) is 'contiguous' but "
        "parallel.cp_sharding is 'zigzag'; fix: give only parallel.cp_sharding"
    ) in found["parallel"]
    data["parallel"]["cp_sharding"] = "contiguous"  # the same value twice is one answer
    with pytest.warns(DeprecationWarning, match=re.escape(OLD_NAME)):
        assert validate_spec(data).parallel.cp_sharding == "contiguous"
