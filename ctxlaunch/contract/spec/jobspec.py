"""`JobSpec`: the sections assembled into one job, the rules that tie them together, and the
quantities derived from them (the degrees, gradient accumulation, the pipeline split)."""

from __future__ import annotations

from typing import Any

from pydantic import PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.contract.spec import rules as spec_rules
from ctxlaunch.contract.spec.cluster_section import ClusterSpec
from ctxlaunch.contract.spec.fabric_section import FabricSpec
from ctxlaunch.contract.spec.fields import (
    MAX_JOB_NAME,
    RFC1123_LABEL,
    _Strict,
    text_problems,
)
from ctxlaunch.contract.spec.heal_rules import heal_problems
from ctxlaunch.contract.spec.model_section import ModelSpec
from ctxlaunch.contract.spec.parallel_section import ParallelSpec
from ctxlaunch.contract.spec.schema import job_schema
from ctxlaunch.contract.spec.secret_refs import env_reference_problems
from ctxlaunch.contract.spec.telemetry_section import TelemetrySpec
from ctxlaunch.contract.spec.training_section import StateEngine, TrainingSpec, resolve_state_engine
from ctxlaunch.contract.stages import balanced_stage_layers


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

    _notes: list[str] = PrivateAttr(default_factory=list)
    """What validation resolved that the user should hear of (a token budget overriding the
    steps given): said among the warnings."""

    @model_validator(mode="before")
    @classmethod
    def _plain_text(cls, data: Any) -> Any:
        """Every string in the spec is one bounded line of text, checked before any field
        reads it (a path with a NUL byte never reaches the file system)."""
        problems = text_problems(data)
        if problems:
            raise ValidationError.from_exception_data("JobSpec", problems)
        return data

    @model_validator(mode="before")
    @classmethod
    def _sharding_for_the_mask(cls, data: Any) -> Any:
        """parallel.cp_sharding left unsaid is balanced under a document mask with a ring (or
        hybrid) CP, whose ranks zigzag leaves unbalanced on packed documents, and zigzag
        otherwise. A sharding the spec states is kept."""
        if not isinstance(data, dict):
            return data
        training = data.get("training")
        parallel = data.get("parallel") or {}
        masked = (
            isinstance(training, dict)
            and isinstance(training.get("data"), dict)
            and training["data"].get("document_mask") is True
        )
        if (
            not masked
            or not isinstance(parallel, dict)
            or "cp_sharding" in parallel
            or "layout" in parallel  # its old name
            or parallel.get("cp_algorithm") == "ulysses"
        ):
            return data
        return {**data, "parallel": {**parallel, "cp_sharding": "balanced"}}

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
        if self.training.tokens is not None:
            # The budget fixes the steps: set here once, so the trainer, the learning-rate
            # schedule, telemetry and the planner all read the same training.steps. The spec
            # is frozen; this is its construction.
            steps = self.steps_for_tokens(self.training.tokens)
            if "steps" in self.training.model_fields_set and steps != self.training.steps:
                self._notes.append(
                    f"training.tokens {self.training.tokens:,} is {steps:,} steps of "
                    f"{self.tokens_per_step:,} tokens: they run, not training.steps "
                    f"{self.training.steps:,}"
                )
            object.__setattr__(self, "training", self.training.model_copy(update={"steps": steps}))
        return self

    def steps_for_tokens(self, tokens: int) -> int:
        """The optimizer steps that train `tokens` tokens at this job's tokens per step."""
        return -(-tokens // self.tokens_per_step)

    # Derived quantities used everywhere; computed, never stored.
    @property
    def parallel_dims(self) -> ParallelDims:
        """Every parallel degree, derived from the parallel and cluster sections."""
        return ParallelDims.from_sections(self.parallel, self.cluster)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step per rank: given, or derived from global_batch."""
        return self.training.grad_accum_at(self.parallel_dims.dp)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.training.micro_batch * self.grad_accum * self.parallel_dims.dp

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
        return resolve_state_engine(t.engine, t.zero_stage, tp=p.tp, pp=p.pp, ep=p.ep)

    @property
    def nvlink_domain(self) -> int:
        return self.fabric.nvlink_domain or self.cluster.gpu_info.nvlink_domain

    def warnings(self) -> list[str]:
        """Legal but poor choices, worth a second look (not errors)."""
        return self._notes + spec_rules.layout_warnings(
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
    """The spec's JSON Schema, for editors (see `schema.job_schema`)."""
    return job_schema(JobSpec)
