"""The job spec: one validated document describing a long-context training job.

This package's face is `JobSpec` and every name of the spec, re-exported from the modules
that define them:

- `fields`: the strict base model, name patterns, the problem record;
- `model_section`: the model section (shape, RoPE scaling, the family, init_from);
- `training_section`: the training section (optimizer, checkpoints, data, evaluation);
- `parallel_section`: the parallel section (`contract.parallel_dims` holds the degrees it sets);
- `cluster_section`, `fabric_section`, `telemetry_section`, `trackers_section`: where the job
  runs, its interconnect, its metrics and its experiment trackers;
- `rules`, `heal_rules`, `secret_refs`: the rules that tie sections together (the parallel
  layout against the model and the cluster, healing, secrets by reference), which report every
  broken rule at once, each at the field it concerns, with the value, the rule and a fix;
- `schema`: the JSON Schema; `jobspec`: `JobSpec`, which assembles the sections.

Field-level rules live on the fields, in the section modules.
"""

from __future__ import annotations

from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec.cluster_section import (
    PROFILE_FORMAT,
    ClusterSpec,
    KubernetesSpec,
    SlurmSpec,
    Toleration,
)
from ctxlaunch.contract.spec.fabric_section import FabricSpec
from ctxlaunch.contract.spec.fields import (
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
    problem_message,
)
from ctxlaunch.contract.spec.jobspec import JobSpec, json_schema, layout_problems
from ctxlaunch.contract.spec.model_section import (
    SHAPE_FIELDS,
    DefaultRope,
    LinearRope,
    Llama3Rope,
    ModelSpec,
    RopeScaling,
    YarnRope,
)
from ctxlaunch.contract.spec.parallel_section import RENAMED_PARALLEL_FIELDS, ParallelSpec
from ctxlaunch.contract.spec.rules import (
    cp_problems,
    eval_problems,
    pipeline_problems,
    tensor_parallel_problems,
)
from ctxlaunch.contract.spec.telemetry_section import TelemetrySpec
from ctxlaunch.contract.spec.trackers_section import (
    MlflowTrackerSpec,
    TensorBoardTrackerSpec,
    TrackerSpec,
    WandbTrackerSpec,
)
from ctxlaunch.contract.spec.training_section import (
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
