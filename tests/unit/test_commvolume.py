"""The communication volumes `ctxlaunch.perf.commvolume` documents, against the bytes each rank
really sends in one training step: every collective and point-to-point send of torch.distributed
is wrapped (multi-process, gloo on CPU) and counted per process group, as its ring algorithm
sends it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from ctxlaunch.contract.loader import validate_spec
from ctxlaunch.perf.commvolume import step_comm_bytes
from ctxlaunch.perf.layout import Layout
from tests.helpers.dist import run_distributed
from tests.helpers.trainer_steps import spec_for

pytestmark = pytest.mark.distributed

COMMON = {"training.global_batch": 4, "training.seq_len": 256}
CASES = [  # (model changes, layout changes), all on four ranks
    ({}, {"parallel.tp": 2, "parallel.cp": 2, "parallel.cp_algorithm": "ring"}),
    (
        {"model.preset": "tiny-mha"},
        {"parallel.tp": 2, "parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
    ),
    ({}, {"parallel.pp": 2}),  # DP 2 x PP 2
]


def _count(rank: int, world: int, specs: list[dict]) -> list[dict]:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    sent: dict[tuple, float] = defaultdict(float)
    state = {"on": False, "phase": "step"}

    def size(group) -> int:  # type: ignore[no-untyped-def]
        return dist.get_world_size(group)

    def wrap(module, name, bytes_of):  # type: ignore[no-untyped-def]
        original = getattr(module, name)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            group = kwargs.get("group")
            if state["on"]:
                key = (name, id(group) if group is not None else None, state["phase"])
                sent[key] += bytes_of(args, kwargs, size(group))
            return original(*args, **kwargs)

        return counted

    ring = {
        "all_gather_single": lambda a, k, g: (g - 1) * a[1].nbytes,
        "reduce_scatter_single": lambda a, k, g: (g - 1) / g * a[1].nbytes,
        "all_reduce": lambda a, k, g: 2 * (g - 1) / g * a[0].nbytes,
        "all_to_all_single": lambda a, k, g: (g - 1) / g * a[1].nbytes,
    }
    for name, fn in ring.items():
        setattr(dist, name, wrap(dist, name, fn))
    isend = wrap(dist, "isend", lambda a, k, g: a[0].nbytes)
    dist.isend = c10d.isend = isend

    out = []
    for spec_data in specs:
        spec = validate_spec(spec_data)
        ctx = build_context(spec.parallel_dims, rank=rank)
        trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
        trainer.train_step()  # warm-up
        finish = trainer.engine.finish_gradients

        def finishing(finish: Callable[[], None] = finish) -> None:  # bound per spec
            state["phase"] = "reduce"
            finish()
            state["phase"] = "step"

        trainer.engine.finish_gradients = finishing
        sent.clear()
        state["on"] = True
        trainer.train_step()
        state["on"] = False
        # Without DP the DP x CP group is the CP group: its all-reduces are the gradients'.
        names = {
            id(g): n
            for n, g in (
                ("dp", ctx.dp_cp_group),
                ("cp", ctx.cp_group),
                ("pp", ctx.pp_group),
                ("tp", ctx.tp_group),
            )
            if g
        }
        by_dim: dict[str, float] = defaultdict(float)
        for (op, group, phase), nbytes in sent.items():
            if op == "all_reduce" and group not in names:
                continue  # the step's loss and stop flag over the whole job (16 bytes)
            if phase == "reduce" or (op == "all_reduce" and names[group] == "cp"):
                dim = "dp"  # gradient reduction (and the TP norm gains)
            else:
                dim = names[group]
            by_dim[dim] += nbytes
        params = (
            sum(p.numel() for _, p in trainer.engine.named_parameters())
            if hasattr(trainer.engine, "named_parameters")
            else 0
        )
        norms = sum(
            p.numel()
            for n, p in trainer.engine.named_parameters()
            if trainer.engine.plan[n] is None
        )
        # The gradient norm's scalar all-reduces over TP and PP (4 bytes each) are not in the
        # model: take them out.
        for dim, groups in (("tp", ctx.tp_group), ("pp", ctx.pp_group)):
            if groups is not None:
                by_dim[dim] -= 2 * (size(groups) - 1) / size(groups) * 4
        out.append(
            {
                "sent": dict(by_dim),
                "params": params,
                "norms": norms,
                "first": trainer.engine.parts.first,
                "last": trainer.engine.parts.last,
            }
        )
    return out


@pytest.mark.timeout(300)
def test_bytes_sent_per_rank_match_the_documented_formulas() -> None:
    specs = [spec_for(4, **model, **layout, **COMMON) for model, layout in CASES]
    ranks = run_distributed(_count, 4, specs, timeout_s=240)
    for index, data in enumerate(specs):
        spec = validate_spec(data)
        p = spec.parallel
        for rank, results in enumerate(ranks):
            got = results[index]
            want = step_comm_bytes(
                spec.model,
                Layout.from_spec(spec).replace(micro_batch=1, dtype="fp32"),
                blocks=spec.stage_layers[got["first"] and 0 or -1] if p.pp > 1 else None,
                first_stage=got["first"],
                last_stage=got["last"],
                stage_params=got["params"],
                norm_params=got["norms"],
            )
            print(
                f"{p.tp=} {p.cp=} {p.pp=} {p.cp_algorithm} rank {rank}: sent "
                + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(got["sent"].items()))
                + f"; formula tp {want.tp:,.0f} cp {want.cp:,.0f} pp {want.pp:,.0f} "
                f"dp {want.dp:,.0f}"
            )
            for dim in ("tp", "cp", "pp", "dp"):
                assert got["sent"].get(dim, 0.0) == pytest.approx(
                    getattr(want, dim), rel=1e-9, abs=1e-6
                ), (dim, rank, got, want)
