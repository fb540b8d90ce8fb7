"""`image check`: whether the image a spec names can start the trainer."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ctxlaunch.cli.common import SetOpt, SpecArg, err, fail, load, out
from ctxlaunch.contract import exitcodes

image = typer.Typer(help="The container image jobs run in.", no_args_is_help=True)


@image.command()
def check(
    spec: SpecArg,
    set_: SetOpt = None,
    via: Annotated[
        str,
        typer.Option(
            help="auto: a local container runtime (docker, podman, nerdctl) when one answers, "
            "else a one-off pod on the spec's cluster; runtime; pod; local: this Python "
            "(no image)."
        ),
    ] = "auto",
    timeout: Annotated[float, typer.Option(help="Seconds the probe may take.")] = 600,
    context: Annotated[str | None, typer.Option(help="kubeconfig context (pod).")] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Machine-readable output: the verdict, where, the output."),
    ] = False,
) -> None:
    """Run the probe (torch at the pinned version, NCCL, the pods' entry point, `ctxlaunch
    train --help`) in cluster.kubernetes.image; exit 0 when it can start the trainer."""
    from ctxlaunch.launch import image as images
    from ctxlaunch.launch.backends.kube_connection import KubeError

    if via not in ("auto", "runtime", "pod", "local"):
        fail(f"--via {via!r}: use auto, runtime, pod or local")
    job = load(spec, set_)
    if via != "local" and not job.cluster.kubernetes.image:
        fail("cluster.kubernetes.image is not set: name the image to check")
    runtime = images.local_runtime() if via in ("auto", "runtime") else None
    if via == "runtime" and runtime is None:
        fail(
            f"no container runtime answers here (tried {', '.join(images.RUNTIMES)})",
            code=exitcodes.FAILED,
        )
    try:
        if via == "local":
            result = images.check_local(job)
        elif runtime is not None:
            result = images.check_runtime(job, runtime, timeout)
        else:
            result = images.check_pod(job, context=context, timeout=timeout)
    except KubeError as exc:
        fail(f"the probe pod could not run: {exc}", code=exitcodes.FAILED)
    if as_json:
        report = {
            "image": job.cluster.kubernetes.image,
            "ok": result.ok,
            "where": result.where,
            "returncode": result.returncode,
            "output": result.output,
        }
        out.print_json(json.dumps(report))
        raise typer.Exit(exitcodes.OK if result.ok else exitcodes.FAILED)
    out.print(result.output.rstrip("\n"), markup=False)
    verdict = "can" if result.ok else "cannot"
    err.print(
        f"{job.cluster.kubernetes.image or 'this environment'} {verdict} start the "
        f"trainer (probe in {result.where}, exit {result.returncode})",
        markup=False,
    )
    raise typer.Exit(exitcodes.OK if result.ok else exitcodes.FAILED)
