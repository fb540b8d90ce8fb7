"""`plan`, `advise` and `calibrate`: what a job needs, and how fast this machine is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ctxlaunch.cli.common import SetOpt, SpecArg, err, fail, load, out, print_warnings
from ctxlaunch.cli.tables import print_plan
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.launch.backends.base import Backend
    from ctxlaunch.launch.jobstore import JobRecord
    from ctxlaunch.perf.machine import Machine

FrameworkOpt = Annotated[
    str,
    typer.Option(
        "--framework",
        help="Whose kernels and overlap to time: ctxlaunch (the bundled trainer, "
        "the default) or megatron (Megatron-LM/NeMo: fused kernels, FP8 recipe, overlapped "
        'gradient collectives); README, "The step-time model\'s constants".',
    ),
]


def _machine(job: JobSpec, framework: str, **kwargs: Any) -> Machine:
    """machine_for with a framework profile; an unknown name is bad input."""
    from ctxlaunch.perf.machine import machine_for
    from ctxlaunch.perf.profiles import PROFILES

    if framework not in PROFILES:
        fail(f"--framework {framework}: not a known profile (known: {', '.join(sorted(PROFILES))})")
    return machine_for(job, framework=framework, **kwargs)


def plan(
    spec: SpecArg,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    framework: FrameworkOpt = "ctxlaunch",
) -> None:
    """Predict per-GPU memory and FLOPs before submitting.

    Fit or not and by how much, the smallest CP degree that fits, the longest sequence at each
    CP degree, and model FLOPs in both MFU conventions."""
    from ctxlaunch.planning.plan import plan_job

    job = load(spec, set_)
    report = plan_job(job, _machine(job, framework))
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    print_warnings(job)
    print_plan(report)


def advise(
    spec: SpecArg,
    set_: SetOpt = None,
    top: Annotated[int, typer.Option("--top", help="Show the N fastest layouts.", min=1)] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", help="Advise for this many GPUs instead of the spec's.", min=1),
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes", help="Advise for this many nodes (of the spec's gpus_per_node).", min=1
        ),
    ] = None,
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
        typer.Option(
            "--write", help="Save the fastest layout as a spec to this file (atomically)."
        ),
    ] = None,
    framework: FrameworkOpt = "ctxlaunch",
) -> None:
    """Rank every legal layout that fits by predicted step time.

    TP within the NVLink domain, PP and virtual stages, CP degree and algorithm, ZeRO stage,
    activation checkpointing and micro-batch, each with predicted memory, step time,
    tokens/s/GPU and MFU in both conventions; the rejected ones grouped by reason."""
    from ctxlaunch.planning.advise import advice_spec_text, load_for_advice, print_advice
    from ctxlaunch.planning.advise import advise as run_advice

    try:
        data, job, note = load_for_advice(spec, set_)
    except SpecError as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(exitcodes.BAD_INPUT) from None
    if gpus is not None and nodes is not None:
        fail("--gpus and --nodes: give one of them")
    per_node = job.cluster.gpus_per_node
    n_nodes = nodes
    if gpus is not None:
        if gpus < per_node:
            n_nodes, per_node = 1, gpus
        elif gpus % per_node:
            fail(
                f"--gpus {gpus}: not a whole number of nodes of {per_node} GPUs "
                "(cluster.gpus_per_node)"
            )
        else:
            n_nodes = gpus // per_node
    if n_nodes is not None and n_nodes > 1 and job.cluster.target == "local":
        fail(
            f"--nodes/--gpus: {n_nodes} nodes, but target local runs on one node; set "
            "cluster.target (e.g. --set cluster.target=slurm)"
        )
    advice = run_advice(
        job,
        nodes=n_nodes,
        gpus_per_node=per_node,
        machine=_machine(job, framework, gpus_per_node=per_node),
        matmul_precision="fp8" if fp8 else None,
    )
    if note:
        advice.notes.insert(0, note)
    if write is not None:
        if advice.best is None:
            fail(f"--write {write}: no layout fits, nothing written")
        text = advice_spec_text(data, advice, str(spec))
        from ctxlaunch.contract.fsutil import atomic_write_text

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
            help="With --submit on Kubernetes: wait up to this many seconds for the "
            "calibration job to end, then save the profile its pod printed to its log.",
            show_default=False,
        ),
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Measure this CPU for the step-time model: matmul (at the model's shapes) and attention
    throughput, memory bandwidth, the model's elementwise rate and fixed cost per micro-batch,
    gloo loopback bandwidth and latency. `advise` and `report` on `gpu: cpu` use
    them (saved in $CTXLAUNCH_HOME/cpu_calibration.json)."""

    from ctxlaunch.runtime.calibrate import ATTENTION_SEQ, measure, save_calibration

    if submit or profile_out is not None or wait_ is not None:
        _submit_calibration(spec, profile_out, set_, wait_)
        return
    model = None
    if spec is not None:
        model = load(spec, set_).model
    try:
        calibration = measure(
            heads=model.heads if model else 4,
            head_dim=model.head_dim if model else 32,
            dtype=model.dtype if model else "fp32",
            model=model,
            attention_seq=ATTENTION_SEQ,
        )
    except RuntimeError as exc:
        fail(str(exc), code=exitcodes.FAILED)
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


def _submit_calibration(
    spec: Path | None,
    profile_out: Path | None,
    overrides: list[str] | None,
    wait: float | None = None,
) -> None:
    """`calibrate SPEC --submit`: the calibration job on one node of the spec's target (the
    bundled calibration, ctxlaunch.runtime.calibrate, run where the trainer would be), then the
    profile it wrote."""
    from ctxlaunch.contract.rundir import TRAINER_MODULE
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.perf.machine import load_profile, profile_path_for
    from ctxlaunch.runtime.calibrate import CALIBRATE_MODULE

    if spec is None:
        fail("--submit: give the SPEC of the cluster to calibrate")
    if wait is not None and wait <= 0:
        fail(f"--wait {wait:g}: give a positive number of seconds")
    job = load(spec, overrides, **{"cluster.nodes": 1, "cluster.profile": None})
    if wait is not None and job.cluster.target != "kubernetes":
        fail(
            f"--wait: for cluster.target kubernetes (the {job.cluster.target} job writes its "
            "profile itself)"
        )
    path = (profile_out or profile_path_for(job, spec)).expanduser().resolve()
    if path.exists() and path.is_dir():
        fail(f"--profile-out {path}: is a directory; give a file path")
    if job.cluster.target == "kubernetes":
        _submit_kubernetes_calibration(job, path, wait)
        return
    if job.cluster.target == "slurm":
        _submit_slurm_calibration(job, path)
        return
    dryrun = get_backend("local").dryrun(job)
    command = list(dryrun.command)
    at = command.index(TRAINER_MODULE)
    # The job's body: the calibration in place of the trainer, one process (it starts the
    # ranks it measures itself).
    command[at:] = [CALIBRATE_MODULE, command[at + 1], "--out", str(path)]
    command = [
        ("--nproc-per-node=1" if part.startswith("--nproc-per-node=") else part) for part in command
    ]
    status = get_backend("local").schedule(dataclasses.replace(dryrun, command=command))
    if status != exitcodes.OK:
        fail(
            f"calibration job {dryrun.job_id} failed (exit {status}); no profile written",
            code=status,
        )
    try:
        load_profile(path)
    except ValueError as exc:
        fail(f"calibration job {dryrun.job_id} ended but {exc}", code=exitcodes.FAILED)
    err.print(f"wrote {path}; name it in the spec as cluster.profile: {path}")


def _submit_slurm_calibration(job: JobSpec, path: Path) -> None:
    """The Slurm calibration job: the spec's own batch script with the calibration as its one
    task in place of the trainer's ranks; sbatch returns at once, the job writes the profile
    (on the shared filesystem) when it ends: `ctxlaunch status` follows it."""
    import shlex

    from ctxlaunch.contract.rundir import TRAINER_MODULE
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.launch.backends.slurm import SlurmError
    from ctxlaunch.runtime.calibrate import CALIBRATE_MODULE

    backend = get_backend("slurm")
    dryrun = backend.dryrun(job)
    script = dryrun.artifact or ""
    body = f"-m {CALIBRATE_MODULE} --out {shlex.quote(str(path))}"
    if f"-m {TRAINER_MODULE} " not in script:
        fail("--submit: the Slurm script has no trainer line to replace", code=exitcodes.FAILED)
    script = script.replace(f"-m {TRAINER_MODULE} ", f"{body} ", 1)
    script = script.replace(
        f"'--ntasks-per-node={job.cluster.gpus_per_node}'", "'--ntasks-per-node=1'", 1
    )
    try:
        status = backend.schedule(dataclasses.replace(dryrun, artifact=script))
    except SlurmError as exc:
        fail(f"--submit: {exc}", code=exitcodes.FAILED)
    if status != exitcodes.OK:
        fail(f"calibration job {dryrun.job_id} was not submitted (exit {status})", code=status)
    err.print(
        f"calibration job {dryrun.job_id} submitted; it writes {path} when it ends "
        f"(ctxlaunch status {dryrun.job_id})"
    )


POD_PROFILE = "/tmp/ctxlaunch-run/profile.json"
"""Where the Kubernetes calibration job writes its profile inside the pod (its log has it too)."""


def _submit_kubernetes_calibration(job: JobSpec, path: Path, wait: float | None) -> None:
    """The Kubernetes calibration job: the spec's own PyTorchJob with the calibration in place
    of the pod entry point, created on the API server; the profile is written in the pod and
    printed to its log, from which `wait` (seconds) brings it to `path` once the job ends."""
    from ctxlaunch.launch.backends.kubernetes import KubernetesBackend
    from ctxlaunch.runtime.calibrate import CALIBRATE_MODULE

    backend = KubernetesBackend()
    dryrun = backend.dryrun(job)
    entry = '"-m", "ctxlaunch.runtime.podentry", "/etc/ctxlaunch/spec.json"]'
    manifest = dryrun.artifact or ""
    if entry not in manifest:
        fail("--submit: the PyTorchJob has no pod entry point to replace", code=exitcodes.FAILED)
    manifest = manifest.replace(
        entry, f'"-m", "{CALIBRATE_MODULE}", "/etc/ctxlaunch/spec.json", "--out", "{POD_PROFILE}"]'
    )
    try:
        record = backend.submit(dataclasses.replace(dryrun, artifact=manifest))
    except RuntimeError as exc:  # the backend's connection and admission errors (KubeError)
        fail(f"--submit: {exc}", code=exitcodes.FAILED)
    print(record.backend_id, flush=True)
    if wait is None:
        err.print(
            f"calibration job {record.backend_id} created; its pod writes {POD_PROFILE} "
            "and prints the profile to its log (`ctxlaunch logs`); with --wait SECONDS "
            "this command saves it here"
        )
        return
    _save_profile_from_log(backend, record, path, wait)


def _save_profile_from_log(backend: Backend, record: JobRecord, path: Path, wait: float) -> None:
    """Wait for the calibration job `record` to end, then write the profile its pod printed
    (the last `PROFILE_LINE` of its log) to `path`, checked before it is written."""
    from ctxlaunch.contract.fsutil import atomic_write_text
    from ctxlaunch.perf.machine import load_profile
    from ctxlaunch.runtime.calibrate import PROFILE_LINE

    job = record.backend_id
    try:
        state = backend.wait(record, wait, poll=2.0)
        lines = backend.read_log(record) if state.state == "COMPLETED" else []
    except (KeyError, RuntimeError) as exc:
        fail(f"calibration job {job}: {exc}", code=exitcodes.FAILED)
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
            code=exitcodes.FAILED,
        )
    printed = [line.split(PROFILE_LINE, 1)[1] for line in lines if PROFILE_LINE in line]
    if not printed:
        fail(
            f"calibration job {job} completed but its log has no profile line; no profile written",
            code=exitcodes.FAILED,
        )
    try:
        text = json.dumps(json.loads(printed[-1]), indent=2) + "\n"
    except ValueError as exc:
        fail(
            f"calibration job {job}: its profile line is not JSON ({exc}); no profile written",
            code=exitcodes.FAILED,
        )
    staged = path.with_name(f".{path.name}.from-log")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(staged, text)
    try:
        load_profile(staged)
    except ValueError as exc:
        staged.unlink()
        fail(f"calibration job {job}: {exc}; no profile written", code=exitcodes.FAILED)
    staged.replace(path)
    err.print(f"wrote {path} from {job}'s log; name it in the spec as cluster.profile: {path}")
