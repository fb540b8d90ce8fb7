"""The VML warm-up (ctxlaunch/runtime/vml.py): oneMKL 2024.2 resolves each VML function's kernel
on its first call, and concurrent first calls from several intra-op threads can run a
low-accuracy kernel for one thread's chunk (pytorch/pytorch#188792). The race needs a storm of
fresh processes to show (benchmarks/vml_first_call.py counts it); these tests check what the
fix relies on: every op it names is one torch computes, the warm-up runs each on the calling
thread alone, and a rank runs it before anything else."""

from __future__ import annotations

import threading

import pytest
import torch

from ctxlaunch.runtime import vml


def test_every_named_op_is_a_torch_unary_op() -> None:
    x = torch.full((4,), 0.5)
    for name in vml.VML_OPS:
        assert getattr(torch, name)(x).shape == x.shape, name


def test_the_warm_up_calls_each_op_once_per_precision_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, torch.dtype, int, int]] = []
    for name in vml.VML_OPS:
        original = getattr(torch, name)

        def record(x: torch.Tensor, _name: str = name, _original=original) -> torch.Tensor:
            calls.append((_name, x.dtype, x.numel(), threading.get_ident()))
            return _original(x)

        monkeypatch.setattr(torch, name, record)
    vml.warm_up()
    assert sorted((n, str(d)) for n, d, _, _ in calls) == sorted(
        (n, str(d)) for n in vml.VML_OPS for d in (torch.float32, torch.float64)
    )
    # One element: below ATen's intra-op grain, so no worker thread runs it.
    assert {numel for _, _, numel, _ in calls} == {1}
    assert {ident for _, _, _, ident in calls} == {threading.get_ident()}


def test_a_rank_warms_vml_before_it_sets_threads_or_joins_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from ctxlaunch.contract.loader import load_spec
    from ctxlaunch.runtime.parallel import rank_setup
    from ctxlaunch.runtime.parallel.distenv import DistEnv
    from tests.helpers.paths import JOBS

    order: list[str] = []
    monkeypatch.setattr(vml, "warm_up", lambda: order.append("warm_up"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: order.append("threads"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def init(**kwargs) -> None:
        order.append("init_process_group")
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", init)
    spec = load_spec(JOBS / "demo.yaml")
    denv = DistEnv(
        rank=0,
        world_size=2,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        launcher="torchrun",
    )
    with pytest.raises(RuntimeError, match="stop here"):
        rank_setup.join_process_group(spec, denv)
    assert order == ["warm_up", "threads", "init_process_group"]
