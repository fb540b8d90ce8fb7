"""training.heal: its spec rules, the planner's re-plan after an out-of-memory and on a changed
allocation (planning.replan.decide, pure), and a re-plan told in words."""

from __future__ import annotations

from ctxlaunch.contract.heal_log import (
    STARTED_AS_SPEC,
    HealHistory,
    OomEntry,
    describe_replan,
)
from ctxlaunch.contract.loader import validate_spec
from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.planning.replan import Allocation, decide
from tests.helpers.specs import make, problems

HEALING = {
    "training.checkpoint.dir": "/shared/ckpt",
    "training.heal.on_oom": "replan",
    "training.heal.on_allocation_change": "replan",
}
"""SPEC (Llama 3 8B, 128K tokens, CP 8, 4 x 8 H100) healing itself on both faults."""


def healing_spec(**changes) -> JobSpec:
    return validate_spec(make(**HEALING, **changes))


def allocation_of(spec: JobSpec, nodes: int) -> Allocation:
    return Allocation(nodes, spec.cluster.gpus_per_node, spec.cluster.gpu_info.memory_bytes)


def test_heal_is_off_by_default_and_needs_checkpoints_that_load_at_any_layout() -> None:
    assert not validate_spec(make()).training.heal.enabled
    found = problems(make(**{"training.heal.on_oom": "replan"}))
    assert "set training.checkpoint.dir" in found["training.checkpoint.dir"]
    found = problems(make(**HEALING, **{"training.zero_stage": 3, "training.engine": "deepspeed"}))
    assert "set training.engine: fsdp2" in found["training.engine"]
    found = problems(make(**{"training.heal.min_nodes": 2}))
    assert "needs heal.on_allocation_change: replan" in found["training.heal.min_nodes"]
    found = problems(make(**HEALING, **{"training.heal.min_nodes": 5}))
    assert "more than cluster.nodes 4" in found["training.heal.min_nodes"]
    found = problems(make(**HEALING, **{"training.heal.max_replans": 0}))
    assert "training.heal.max_replans" in found


def test_the_first_run_on_its_own_allocation_trains_at_its_own_layout() -> None:
    spec = healing_spec()
    decision = decide(spec, allocation_of(spec, 4), HealHistory())
    assert decision.give_up is None and not decision.replanned
    assert decision.why == STARTED_AS_SPEC
    assert (
        decision.spec.parallel.cp == spec.parallel.cp
        and decision.spec.parallel_dims.dp == spec.parallel_dims.dp
    )


def test_an_oom_replans_to_a_layout_that_fits_with_the_measured_peak() -> None:
    spec = healing_spec()
    allocation = allocation_of(spec, 4)
    history = HealHistory()
    first = decide(spec, allocation, history)
    history.layouts.append(first.entry)
    measured = int(first.entry.predicted_peak_bytes * 1.5)
    oom = OomEntry(
        source="allocator",
        phase="forward/backward",
        step=412,
        rank=3,
        measured_peak_bytes=measured,
        capacity_bytes=allocation.capacity_bytes,
    )
    history.ooms.append((len(history.layouts), oom))
    healed = decide(spec, allocation, history, step=400, restart=1)
    assert healed.give_up is None and healed.replanned and healed.why == "oom"
    # The planner learns from the miss: the measured over the predicted peak is its margin.
    assert healed.entry.margin >= 1.5
    assert healed.entry.key != first.entry.key
    assert healed.entry.predicted_peak_bytes * healed.entry.margin <= allocation.capacity_bytes
    assert healed.figures["measured_peak_bytes"] == measured
    # The run stays the same run: the GPUs, the global batch and the sequence length hold.
    assert healed.spec.global_batch == spec.global_batch
    assert healed.spec.training.seq_len == spec.training.seq_len
    assert healed.spec.cluster.nodes * healed.spec.cluster.gpus_per_node == 32
    # Its re-plans are bounded: the next OOM of a job with no re-plans left ends it.
    history.layouts.append(healed.entry)
    history.ooms.append((len(history.layouts), oom))
    spent = healing_spec(**{"training.heal.max_replans": 1})
    ended = decide(spent, allocation, history, step=400, restart=2)
    assert ended.give_up is not None and "max_replans (1)" in ended.give_up


def test_fewer_nodes_shrink_the_layout_and_more_grow_it_back() -> None:
    # A layout the planner says fits (about 17 GiB of 80): on its own nodes it is chosen again.
    spec = healing_spec(
        **{
            "training.activation_checkpointing": "full",
            "training.zero_stage": 3,
            "training.engine": "fsdp2",
        }
    )
    history = HealHistory()
    history.layouts.append(decide(spec, allocation_of(spec, 4), history).entry)
    shrunk = decide(spec, allocation_of(spec, 2), history, step=100, restart=1)
    assert shrunk.give_up is None and shrunk.replanned and shrunk.why == "allocation"
    assert shrunk.spec.cluster.nodes == 2 and shrunk.entry.nodes == 2
    assert shrunk.spec.global_batch == spec.global_batch
    history.layouts.append(shrunk.entry)
    again = decide(spec, allocation_of(spec, 2), history, step=120, restart=2)
    assert not again.replanned and again.entry.key == shrunk.entry.key
    history.layouts.append(again.entry)
    grown = decide(spec, allocation_of(spec, 4), history, step=140, restart=3)
    assert grown.replanned and grown.why == "allocation"
    assert grown.entry.key == history.layouts[0].key  # its own layout on its own nodes


def test_a_job_that_waits_for_its_nodes_does_not_start_on_fewer() -> None:
    spec = validate_spec(
        make(**{"training.checkpoint.dir": "/c", "training.heal.on_oom": "replan"})
    )
    decision = decide(spec, allocation_of(spec, 2), HealHistory())
    assert decision.give_up is not None and "on_allocation_change is wait" in decision.give_up


def test_a_replan_in_words() -> None:
    fields = {
        "why": "oom",
        "fault_step": 412,
        "step": 400,
        "figures": {"phase": "forward/backward", "source": "allocator"},
        "from": {"changes": {"parallel.cp": 4, "training.activation_checkpointing": "none"}},
        "to": {"changes": {"parallel.cp": 8, "training.activation_checkpointing": "selective"}},
    }
    assert describe_replan(fields) == (
        "OOM (forward/backward) at step 412 with cp 4, checkpointing none; "
        "resumed at step 400 with cp 8, checkpointing selective"
    )
    grown = {
        "why": "allocation",
        "step": 40,
        "from": {"nodes": 1, "changes": {"parallel.cp": 1}},
        "to": {"nodes": 2, "changes": {"parallel.cp": 2}},
    }
    assert describe_replan(grown).startswith("allocation grown back to 2 nodes from 1")
    shrunk = {**grown, "from": grown["to"], "to": grown["from"]}
    assert describe_replan(shrunk).startswith("allocation of 1 node instead of 2")


def test_a_node_range_asks_for_cpus_per_node_so_it_starts_at_its_maximum() -> None:
    """A healing job's script asks for MIN-MAX nodes with the CPUs each node's tasks need, not
    --ntasks-per-node (with which Slurm gives the range its minimum even when every node is
    idle: tests/service/slurm_prometheus/test_slurm_healing.py starts on both nodes); srun
    still places one task per GPU on each node it got."""
    from ctxlaunch.launch.render import render

    def directives_and_srun(spec: JobSpec) -> tuple[list[str], str]:
        text = render(spec, "slurm")
        lines = text.splitlines()
        found = [line.split(" ", 1)[1] for line in lines if line.startswith("#SBATCH ")]
        return found, next(line for line in lines if line.startswith("srun "))

    ranged, srun = directives_and_srun(
        healing_spec(**{"training.heal.min_nodes": 2, "cluster.slurm.cpus_per_task": 4})
    )
    assert "--nodes=2-4" in ranged and "--mincpus=32" in ranged, ranged
    assert not any(d.startswith("--ntasks-per-node") for d in ranged), ranged
    assert "--ntasks-per-node=8" in srun
    fixed, srun = directives_and_srun(validate_spec(make()))
    assert "--nodes=4" in fixed and "--ntasks-per-node=8" in fixed
    assert not any(d.startswith("--mincpus") for d in fixed)
    assert "--ntasks-per-node=8" in srun
