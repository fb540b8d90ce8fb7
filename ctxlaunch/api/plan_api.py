"""Before a job runs: its plan (memory, step time, the whole run's time, GPU-hours, energy and
cost) and the advice (every layout that fits, ranked by step, time to train or cost)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ctxlaunch.api.errors import ApiError
from ctxlaunch.api.spec_api import SpecLike, load_spec, spec_data

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.perf.machine import Machine
    from ctxlaunch.planning.advise import Advice
    from ctxlaunch.planning.plan import PlanReport


def machine(
    job: JobSpec, framework: str = "ctxlaunch", gpus_per_node: int | None = None
) -> Machine:
    """The machine `job` is predicted on (perf.machine.machine_for) with a framework profile;
    ApiError for an unknown profile."""
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.profiles import PROFILES

    if framework not in PROFILES:
        raise ApiError(
            f"--framework {framework}: not a known profile (known: {', '.join(sorted(PROFILES))})"
        )
    return machine_for(job, framework=framework, gpus_per_node=gpus_per_node)


def plan(
    spec: SpecLike, overrides: Iterable[str] = (), *, framework: str = "ctxlaunch"
) -> PlanReport:
    """What `ctxlaunch plan` reports: per-GPU memory against capacity, the CP degrees that fit,
    FLOPs, the predicted step and the whole run (time to train, GPU-hours, energy, cost)."""
    from ctxlaunch.planning.plan import plan_job

    job = load_spec(spec, overrides)
    return plan_job(job, machine(job, framework))


def _gpu_counts(
    job: JobSpec, gpus: Sequence[int], nodes: Sequence[int]
) -> list[tuple[int | None, int]]:
    """(nodes, GPUs per node) for each count asked (`--gpus`, `--nodes`), the spec's own
    (None nodes) when none is."""
    from ctxlaunch.contract.spec import problem_message
    from ctxlaunch.contract.spec.rules import target_problems

    if gpus and nodes:
        raise ApiError("--gpus and --nodes: give one of them")
    per_node = job.cluster.gpus_per_node
    counts: list[tuple[int | None, int]] = [(n, per_node) for n in nodes]
    for count in gpus:
        if count < per_node:
            counts.append((1, count))
        elif count % per_node:
            raise ApiError(
                f"--gpus {count}: not a whole number of nodes of {per_node} GPUs "
                "(cluster.gpus_per_node)"
            )
        else:
            counts.append((count // per_node, per_node))
    for n_nodes, _ in counts:
        # The spec's own rule for what its target allows, on the node count asked for.
        problems = target_problems(job.cluster.model_copy(update={"nodes": n_nodes}))
        if problems:
            raise ApiError(
                f"--nodes/--gpus: {n_nodes} nodes, but {problem_message(problems[0])}; set "
                "cluster.target (e.g. --set cluster.target=slurm)"
            )
    return counts or [(None, per_node)]


def advise(
    spec: SpecLike,
    overrides: Iterable[str] = (),
    *,
    gpus: Sequence[int] = (),
    nodes: Sequence[int] = (),
    rank_by: str = "step",
    fp8: bool = False,
    framework: str = "ctxlaunch",
) -> Advice:
    """Every legal layout that fits, ranked by `rank_by` (step: the predicted step; time: the
    time to train the run; cost: its GPU-hours at cluster.gpu_hour_price), on the spec's GPUs
    or on each count of `gpus` (or `nodes`) merged into one ranking. A spec whose only problems
    are its layout is advised on (the Advice's first note says so)."""
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.planning.advise import RANK_BY, load_for_advice, merge
    from ctxlaunch.planning.advise import advise as run_advice

    if rank_by not in RANK_BY:
        raise ApiError(f"--rank-by {rank_by}: use one of {', '.join(RANK_BY)}")
    if isinstance(spec, JobSpec):
        spec = spec.model_dump(mode="json")
    source = str(spec) if isinstance(spec, (str, Path)) else "<spec>"
    _, job, note = load_for_advice(spec_data(spec, overrides), None, source)
    if rank_by == "cost" and job.cluster.price_per_gpu_hour is None:
        raise ApiError(
            f"--rank-by cost: cluster.gpu_hour_price gives no price for {job.cluster.gpu}; set "
            "it (e.g. --set cluster.gpu_hour_price=2.5)"
        )
    advices = []
    for n_nodes, per_node in _gpu_counts(job, gpus, nodes):
        on = machine(job, framework, gpus_per_node=per_node)
        if fp8 and "fp8" not in on.peak_flops:
            raise ApiError(
                f"--fp8: cluster.gpu {job.cluster.gpu} has no FP8 matmul rate to time it with"
            )
        advices.append(
            run_advice(
                job,
                nodes=n_nodes,
                gpus_per_node=per_node,
                machine=on,
                matmul_precision="fp8" if fp8 else None,
            )
        )
    advice = merge(advices, rank_by) if len(advices) > 1 else advices[0]
    if len(advices) == 1:
        advice.rerank(rank_by)
    if note:
        advice.notes.insert(0, note)
    return advice
