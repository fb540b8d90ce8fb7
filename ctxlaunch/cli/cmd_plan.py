"""`plan`, `advise` and `calibrate`: what a job needs, and how fast the machine it runs on is."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ctxlaunch.cli.common import SetOpt, SpecArg, err, fail, load, out, print_warnings
from ctxlaunch.cli.extras import require
from ctxlaunch.cli.tables import print_plan
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError

if TYPE_CHECKING:
    from ctxlaunch.launch.backends.base import Backend
    from ctxlaunch.launch.jobstore import JobRecord

FrameworkOpt = Annotated[
    str,
    typer.Option(
        "--framework",
        help="Whose kernels and overlap to time: ctxlaunch (the bundled trainer, "
        "the default) or megatron (Megatron-LM/NeMo: fused kernels, FP8 recipe, overlapped "
        "gradient collectives); docs/concepts/step-time-model.md.",
    ),
]


def plan(
    spec: SpecArg,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    framework: FrameworkOpt = "ctxlaunch",
) -> None:
    """Predict per-GPU memory, FLOPs, the step and the whole run before submitting.

    Fit or not and by how much, the smallest CP degree that fits, the longest sequence at each
    CP degree, model FLOPs in both MFU conventions, and the run's time to train, GPU-hours,
    energy and (with cluster.gpu_hour_price) cost, each with the step time's expected error."""
    from ctxlaunch import api

    job = load(spec, set_)
    try:
        report = api.plan(job, framework=framework)
    except api.ApiError as exc:
        fail(str(exc))
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    print_warnings(job)
    print_plan(report)


def advise(
    spec: SpecArg,
    set_: SetOpt = None,
    top: Annotated[int, typer.Option("--top", help="Show the N best layouts.", min=1)] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    gpus: Annotated[
        list[int] | None,
        typer.Option(
            "--gpus",
            help="Advise for this many GPUs instead of the spec's; repeat it to rank several "
            "counts together (--rank-by time or cost then weighs them).",
            min=1,
        ),
    ] = None,
    nodes: Annotated[
        list[int] | None,
        typer.Option(
            "--nodes",
            help="Advise for this many nodes (of the spec's gpus_per_node); repeatable.",
            min=1,
        ),
    ] = None,
    rank_by: Annotated[
        str,
        typer.Option(
            "--rank-by",
            help="step: the predicted step time; time: the time to train the run "
            "(training.steps or training.tokens); cost: its GPU-hours at cluster.gpu_hour_price.",
        ),
    ] = "step",
    fp8: Annotated[
        bool,
        typer.Option(
            "--fp8",
            help="Time the weight matmuls in FP8 (Transformer Engine recipes; the "
            "bundled trainer runs bf16/fp32).",
        ),
    ] = False,
    write: Annotated[
        Path | None,
        typer.Option("--write", help="Save the best layout as a spec to this file (atomically)."),
    ] = None,
    framework: FrameworkOpt = "ctxlaunch",
) -> None:
    """Rank every legal layout that fits by predicted step time, time to train or cost.

    TP within the NVLink domain, PP and virtual stages, CP degree and algorithm, ZeRO stage,
    activation checkpointing and micro-batch, each with predicted memory, step time,
    tokens/s/GPU, MFU in both conventions and the run's time to train (and cost); the rejected
    ones grouped by reason."""
    from ctxlaunch import api
    from ctxlaunch.planning.advise import advice_spec_text, print_advice

    try:
        advice = api.advise(
            spec,
            set_ or (),
            gpus=gpus or (),
            nodes=nodes or (),
            rank_by=rank_by,
            fp8=fp8,
            framework=framework,
        )
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    except api.ApiError as exc:
        fail(str(exc))
    if write is not None:
        if advice.best is None:
            fail(f"--write {write}: no layout fits, nothing written")
        from ctxlaunch.contract.fsutil import atomic_write_text

        text = advice_spec_text(api.spec_data(spec, set_ or ()), advice, str(spec))
        atomic_write_text(write, text)
        err.print(f"wrote {write}: {advice.best.describe()}")
    if as_json:
        out.print_json(json.dumps(advice.to_dict(top)))
        return
    print_advice(out, advice, top)


def calibrate(
    spec: Annotated[
        Path | None,
        typer.Argument(
            help="Measure attention at this spec's model shape and dtype (default: the tiny "
            "preset, fp32).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    submit: Annotated[
        bool,
        typer.Option(
            "--submit",
            help="Run the calibration as a one-node job through the spec's own target "
            "and save a machine profile (keyed by GPU type and fabric) that cluster.profile can "
            "name.",
        ),
    ] = False,
    profile_out: Annotated[
        Path | None,
        typer.Option(
            "--profile-out",
            help="Where --submit saves the profile (default: "
            "profiles/<gpu>-<fabric>.json beside the spec).",
            show_default=False,
        ),
    ] = None,
    wait_: Annotated[
        float | None,
        typer.Option(
            "--wait",
            help="With --submit: wait up to this many seconds for the calibration job to "
            "end, then save the profile it returned (a Slurm job's through submitit, a pod's "
            "from its log).",
            show_default=False,
        ),
    ] = None,
    set_: SetOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Save the calibration even where other processes held the cores or its "
            "readings disagree (saying what was seen).",
        ),
    ] = False,
) -> None:
    """Measure this CPU for the step-time model: matmul (at the model's shapes) and attention
    throughput, memory bandwidth, the model's elementwise rate and fixed cost per micro-batch,
    gloo loopback bandwidth and latency. `advise` and `report` on `gpu: cpu` use
    them (saved in $CTXLAUNCH_HOME/cpu_calibration.json).

    It watches what else runs on the cores, before and while it measures, and whether its
    readings agree; where other processes hold the cores or the readings disagree beyond their
    spread, it saves nothing and says what it saw (exit 1), unless --force. Its progress gives
    the time left from its own first readings."""
    import dataclasses as dc

    from ctxlaunch.perf.machine import save_calibration
    from ctxlaunch.runtime.calibration import trust
    from ctxlaunch.runtime.calibration.cpu import ATTENTION_SEQ, measure

    if submit or profile_out is not None or wait_ is not None:
        _submit_calibration(spec, profile_out, set_, wait_)
        return
    model = None
    if spec is not None:
        model = load(spec, set_).model
    require("calibrate", "torch")  # what measures: said before the machine is looked at
    cores = os.cpu_count() or 1
    # Before anything is measured: a machine someone else keeps busy is refused in a second.
    before = trust.judge(others_cores=trust.others_busy_cores(1.0), cores=cores)
    if before and not force:
        fail(_refusal(before), code=exitcodes.FAILED)
    watch = trust.LoadWatch().start()
    try:
        calibration = measure(
            heads=model.heads if model else 4,
            head_dim=model.head_dim if model else 32,
            dtype=model.dtype if model else "fp32",
            model=model,
            attention_seq=ATTENTION_SEQ,
            show_progress=True,
        )
    except RuntimeError as exc:
        fail(str(exc), code=exitcodes.FAILED)
    calibration, reasons = _judged(calibration, watch.others_cores(), cores, before)
    if reasons and not force:
        fail(_refusal(reasons), code=exitcodes.FAILED)
    for reason in reasons:
        err.print(f"warning: saved with --force although {reason}", markup=False)
    calibration = (
        dc.replace(calibration, trust={**(calibration.trust or {}), "forced_over": reasons})
        if reasons
        else calibration
    )
    path = save_calibration(calibration)
    if as_json:
        out.print_json(json.dumps(dataclasses.asdict(calibration)))
    else:
        c = calibration
        out.print(
            f"matmul {c.matmul_flops_per_second / 1e9:.1f} GFLOP/s, attention "
            f"{c.attention_flops_per_second / 1e9:.1f} GFLOP/s, memory "
            f"{c.memory_bytes_per_second / 1e9:.1f} GB/s, elementwise "
            f"{c.elementwise_bytes_per_second / 1e9:.2f} GB/s, gloo loopback "
            f"{c.link_bytes_per_second / 1e9:.2f} GB/s + {c.link_latency_seconds * 1e6:.0f}"
            f" us, {c.microbatch_overhead_seconds * 1e3:.1f} ms fixed per micro-batch "
            f"({c.cores} cores)"
        )
        if c.one_thread:
            one = c.one_thread
            out.print(
                f"one thread: matmul {one['matmul'] / 1e9:.1f} GFLOP/s, attention "
                f"{one['attention'] / 1e9:.1f} GFLOP/s, elementwise "
                f"{one['elementwise'] / 1e9:.2f} GB/s"
            )
    err.print(f"wrote {path}")


def _refusal(reasons: list[str]) -> str:
    """Why `calibrate` saved nothing, in one sentence."""
    return (
        "calibrate saved nothing: " + "; ".join(reasons) + ". Measure on a quiet machine, or "
        "pass --force to save it anyway"
    )


def _judged(
    calibration: Any, others: float | None, cores: int, before: list[str]
) -> tuple[Any, list[str]]:
    """The calibration with what was seen while it measured (runtime.calibration.trust), and
    each reason not to trust it (those seen before it started first)."""
    import dataclasses as dc

    from ctxlaunch.runtime.calibration import trust

    readings = (calibration.trust or {}).get("readings", {})
    one = calibration.one_thread or {}
    reasons = before + trust.judge(
        others_cores=others,
        cores=cores,
        readings=readings,
        all_cores={
            "matmul": calibration.matmul_flops_per_second,
            "attention": calibration.attention_flops_per_second,
        },
        one_thread={k: one[k] for k in ("matmul", "attention") if k in one},
    )
    seen = {
        **(calibration.trust or {}),
        "others_cores": others,
        "spread": {name: trust.spread(values) for name, values in readings.items()},
    }
    return dc.replace(calibration, trust=seen), list(dict.fromkeys(reasons))


def _submit_calibration(
    spec: Path | None,
    profile_out: Path | None,
    overrides: list[str] | None,
    wait: float | None = None,
) -> None:
    """`calibrate SPEC --submit`: the calibration job (contract.rundir.calibration_entry) on one
    node of the spec's target, rendered and submitted by its backend like any job; then the
    profile it returns, written where the user asked. A job on this machine ends before
    `submit` returns; elsewhere `--wait` waits for it, else a job that shares this filesystem
    writes the profile itself and any other prints it to its log."""
    from ctxlaunch.contract.rundir import calibration_entry
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.perf.machine import profile_path_for

    if spec is None:
        fail("--submit: give the SPEC of the cluster to calibrate")
    if wait is not None and wait <= 0:
        fail(f"--wait {wait:g}: give a positive number of seconds")
    job = load(spec, overrides, **{"cluster.nodes": 1, "cluster.profile": None})
    path = (profile_out or profile_path_for(job, spec)).expanduser().resolve()
    if path.exists() and path.is_dir():
        fail(f"--profile-out {path}: is a directory; give a file path")
    backend = get_backend(job.cluster.target)
    entry = calibration_entry(str(path) if backend.shares_filesystem else None)
    try:
        record = backend.submit(backend.dryrun(job, entry))
        state = backend.status(record)
    except (RuntimeError, KeyError) as exc:  # the backends' scheduler and connection errors
        fail(f"--submit: {exc}", code=exitcodes.FAILED)
    print(record.backend_id, flush=True)
    if not state.terminal and wait is None:
        where = (
            f"it writes {path} when it ends"
            if entry.result_file
            else "it prints the profile to its log (`ctxlaunch logs`); with --wait SECONDS this "
            "command saves it"
        )
        err.print(
            f"calibration job {record.backend_id} submitted; {where} "
            f"(`ctxlaunch status {record.backend_id}`)"
        )
        return
    _save_profile(backend, record, path, wait)


def _save_profile(backend: Backend, record: JobRecord, path: Path, wait: float | None) -> None:
    """Wait up to `wait` seconds (None: the job has ended) for the calibration job `record`,
    then write the profile it returned to `path`, checked before it is written."""
    from ctxlaunch.contract.fsutil import atomic_write_text
    from ctxlaunch.perf.machine import load_profile

    job = record.backend_id
    try:
        state = backend.wait(record, wait, poll=2.0) if wait else backend.status(record)
        result = backend.result(record) if state.state == "COMPLETED" else None
    except (KeyError, RuntimeError, ValueError) as exc:
        fail(f"calibration job {job}: {exc}; no profile written", code=exitcodes.FAILED)
    if not state.terminal:
        fail(
            f"calibration job {job} still {state.state} after {wait:g} s; no profile written "
            f"(`ctxlaunch status {job}`)",
            code=exitcodes.FAILED,
        )
    if state.state != "COMPLETED":
        why = "; ".join(backend.explain(record, state))
        fail(
            f"calibration job {job} ended {state.state}{': ' + why if why else ''}; no "
            "profile written",
            code=state.exit_code if state.exit_code not in (None, 0) else exitcodes.FAILED,
        )
    text = json.dumps(result, indent=2) + "\n"
    staged = path.with_name(f".{path.name}.from-job")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(staged, text)
    try:
        load_profile(staged)
    except ValueError as exc:
        staged.unlink()
        fail(f"calibration job {job}: {exc}; no profile written", code=exitcodes.FAILED)
    staged.replace(path)
    err.print(f"wrote {path}; name it in the spec as cluster.profile: {path}")
