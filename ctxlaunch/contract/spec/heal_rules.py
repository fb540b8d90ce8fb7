"""The rules that tie `training.heal` to the rest of the spec: a job that heals itself resumes
from its newest checkpoint at another layout, so it needs checkpoints, and checkpoints that
load at any layout; and it can shrink only to nodes it asked for."""

from __future__ import annotations

from pydantic_core import InitErrorDetails

from ctxlaunch.contract.spec.cluster_section import ClusterSpec
from ctxlaunch.contract.spec.fields import _problem
from ctxlaunch.contract.spec.training_section import TrainingSpec


def heal_problems(
    training: TrainingSpec, cluster: ClusterSpec, state_engine: str
) -> list[InitErrorDetails]:
    """Every broken rule of `training.heal` against the training and cluster sections, where
    `state_engine` is what keeps the model states (`JobSpec.state_engine`)."""
    heal = training.heal
    out: list[InitErrorDetails] = []
    if heal.min_nodes is not None and heal.min_nodes > cluster.nodes:
        out.append(
            _problem(
                ("training", "heal", "min_nodes"),
                heal.min_nodes,
                f"heal.min_nodes {heal.min_nodes} is more than cluster.nodes {cluster.nodes}: "
                "the job asks for min_nodes to cluster.nodes nodes; lower it",
            )
        )
    if not heal.enabled:
        return out
    if training.checkpoint.dir is None:
        out.append(
            _problem(
                ("training", "checkpoint", "dir"),
                None,
                "training.heal resumes a re-planned job from its newest checkpoint: set "
                "training.checkpoint.dir (on storage every node and every restart sees)",
            )
        )
    if state_engine == "deepspeed":
        out.append(
            _problem(
                ("training", "engine"),
                training.engine,
                f"training.heal re-plans the layout and resumes the checkpoint at the new one, "
                f"but ZeRO-{training.zero_stage} through DeepSpeed (training.engine "
                f"{training.engine}) writes checkpoints that resume only at their own layout: "
                "set training.engine: fsdp2 (FSDP2 checkpoints resume at any TP, PP, CP and DP "
                "degree)",
            )
        )
    return out
