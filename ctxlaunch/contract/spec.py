"""The job spec: one validated document describing a long-context training job.

This module is its public face: `JobSpec`, which assembles the sections, and every name of
the spec, re-exported from the modules that define them:

- `spec_base`: the strict base model, name patterns, the problem record;
- `spec_model`: the model section (shape, RoPE scaling, presets, init_from);
- `spec_training`: the training section (optimizer, checkpoints, data, evaluation);
- `spec_parallel`: the parallel section; `parallel_dims`: the degrees derived from it;
- `spec_cluster`: the cluster, fabric and telemetry sections;
- `spec_rules`: the rules that tie sections together (the parallel layout against the model
  and the cluster), which report every broken rule at once, each at the field it concerns,
  with the value, the rule and a fix;
- `spec_schema`: the JSON Schema.

Field-level rules live on the fields, in the section modules.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from ctxlaunch.contract import spec_rules
from ctxlaunch.contract.heal_rules import heal_problems
from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec_base import (
    ENV_NAME,
    IMAGE_REF,
    K8S_QUANTITY,
    LABEL_KEY,
    LABEL_VALUE,
    MAX_JOB_NAME,
    RFC1123_LABEL,
    RFC1123_SUBDOMAIN,
    SLURM_NAME,
    SLURM_TIME,
    PositiveInt,
    _Strict,
    problem_message,
    text_problems,
)
from ctxlaunch.contract.spec_cluster import (
    PROFILE_FORMAT,
    ClusterSpec,
    FabricSpec,
    KubernetesSpec,
    MlflowTrackerSpec,
    SlurmSpec,
    TelemetrySpec,
    TensorBoardTrackerSpec,
    Toleration,
    TrackerSpec,
    WandbTrackerSpec,
)
from ctxlaunch.contract.spec_model import (
    SHAPE_FIELDS,
    DefaultRope,
    LinearRope,
    Llama3Rope,
    ModelSpec,
    RopeScaling,
    YarnRope,
)
from ctxlaunch.contract.spec_parallel import RENAMED_PARALLEL_FIELDS, ParallelSpec
from ctxlaunch.contract.spec_rules import (
    cp_problems,
    eval_problems,
    pipeline_problems,
    tensor_parallel_problems,
)
from ctxlaunch.contract.spec_schema import job_schema
from ctxlaunch.contract.spec_secrets import env_reference_problems
from ctxlaunch.contract.spec_training import (
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    HealSpec,
    OffloadSpec,
    OptimizerSpec,
    PasskeySpec,
    StateEngine,
    TrainingSpec,
    indexed_files,
    indexed_prefix,
    loss_mask_file,
    resolve_state_engine,
)
from ctxlaunch.contract.stages import balanced_stage_layers

__all__ = [
    "ENV_NAME",
    "IMAGE_REF",
    "K8S_QUANTITY",
    "LABEL_KEY",
    "LABEL_VALUE",
    "MAX_JOB_NAME",
    "PROFILE_FORMAT",
    "RENAMED_PARALLEL_FIELDS",
    "RFC1123_LABEL",
    "RFC1123_SUBDOMAIN",
    "SHAPE_FIELDS",
    "SLURM_NAME",
    "SLURM_TIME",
    "CheckpointSpec",
    "ClusterSpec",
    "DataSpec",
    "DefaultRope",
    "EvalSpec",
    "FabricSpec",
    "HealSpec",
    "JobSpec",
    "KubernetesSpec",
    "LinearRope",
    "Llama3Rope",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelDims",
    "ParallelSpec",
    "PasskeySpec",
    "PositiveInt",
    "RopeScaling",
    "SlurmSpec",
    "StateEngine",
    "MlflowTrackerSpec",
    "OffloadSpec",
    "TelemetrySpec",
    "TensorBoardTrackerSpec",
    "TrackerSpec",
    "WandbTrackerSpec",
    "Toleration",
    "TrainingSpec",
    "YarnRope",
    "cp_problems",
    "eval_problems",
    "indexed_files",
    "indexed_prefix",
    "loss_mask_file",
    "json_schema",
    "layout_problems",
    "pipeline_problems",
    "problem_message",
    "resolve_state_engine",
    "tensor_parallel_problems",
]


class JobSpec(_Strict):
    """A long-context training job: model, training, parallel layout, cluster, fabric,
    telemetry."""

    name: str
    """Job name: an RFC 1123 label of at most 48 characters (it names pods and Slurm jobs)."""
    model: ModelSpec
    training: TrainingSpec
    parallel: ParallelSpec = ParallelSpec()
    cluster: ClusterSpec = ClusterSpec()
    fabric: FabricSpec = FabricSpec()
    telemetry: TelemetrySpec = TelemetrySpec()

    @model_validator(mode="before")
    @classmethod
    def _plain_text(cls, data: Any) -> Any:
        """Every string in the spec is one bounded line of text, checked before any field
        reads it (a path with a NUL byte never reaches the file system)."""
        problems = text_problems(data)
        if problems:
            raise ValidationError.from_exception_data("JobSpec", problems)
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > MAX_JOB_NAME or not RFC1123_LABEL.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a valid job name: lowercase letters, digits and '-', "
                f"starting and ending with a letter or digit, at most {MAX_JOB_NAME} "
                "characters (it names Slurm jobs and Kubernetes pods)"
            )
        return value

    @model_validator(mode="after")
    def _check_layout(self) -> JobSpec:
        problems = layout_problems(self)
        problems += spec_rules.profile_problems(self.cluster, self.fabric)
        problems += env_reference_problems(self.cluster.target, self.fabric.env)
        problems += heal_problems(self.training, self.cluster, self.state_engine)
        if problems:
            raise ValidationError.from_exception_data("JobSpec", problems)
        return self

    # Derived quantities used everywhere; computed, never stored.
    @property
    def parallel_dims(self) -> ParallelDims:
        """Every parallel degree, derived from the parallel and cluster sections."""
        return ParallelDims.from_sections(self.parallel, self.cluster)

    @property
    def dp(self) -> int:
        """Data parallel degree: given, or the GPU count over tp x pp x cp x ep."""
        return self.parallel_dims.dp

    @property
    def ulysses_degree(self) -> int:
        """Ulysses (inner) degree of the CP group: cp for ulysses, 1 for ring."""
        return self.parallel_dims.ulysses

    @property
    def ring_degree(self) -> int:
        """Ring (outer) degree of the CP group."""
        return self.parallel_dims.ring

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step per rank: given, or derived from global_batch."""
        return self.training.grad_accum_at(self.dp)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.training.micro_batch * self.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.training.seq_len

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Blocks per pipeline stage (pp x virtual_stages entries), given or balanced."""
        p = self.parallel
        if p.stage_layers is not None:
            return tuple(p.stage_layers)
        return balanced_stage_layers(self.model.layers, p.pp * p.virtual_stages)

    @property
    def state_engine(self) -> StateEngine:
        """What keeps the model states: the one rule the trainer and the planner both read."""
        t, p = self.training, self.parallel
        return resolve_state_engine(t.engine, t.zero_stage, tp=p.tp, pp=p.pp)

    @property
    def nvlink_domain(self) -> int:
        return self.fabric.nvlink_domain or self.cluster.gpu_info.nvlink_domain

    def warnings(self) -> list[str]:
        """Legal but poor choices, worth a second look (not errors)."""
        return spec_rules.layout_warnings(
            self.model,
            self.training,
            self.parallel,
            self.cluster,
            self.parallel_dims,
            self.nvlink_domain,
        )


def layout_problems(spec: JobSpec) -> list[InitErrorDetails]:
    """Every rule that ties the job's layout to its model and cluster; all broken ones at once
    (`spec_rules.layout_problems` on the job's sections and degrees)."""
    return spec_rules.layout_problems(
        spec.model, spec.training, spec.parallel, spec.cluster, spec.parallel_dims
    )


def json_schema() -> dict[str, Any]:
    """The spec's JSON Schema, for editors (see `spec_schema.job_schema`)."""
    return job_schema(JobSpec)
