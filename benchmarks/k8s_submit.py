"""`ctxlaunch submit` against plain `kubectl apply -f` of the same rendered files, on the same
Kubernetes API server.

    .venv/bin/python benchmarks/k8s_submit.py [--reps 5] [--api pytorchjob|trainjob]

Needs the test API server (scripts/services/kubernetes.sh start; it uses its admin
kubeconfig) and the project's kubectl (.venv/bin/kubectl). Renders the demo spec for
Kubernetes once per repetition (a job name of its own each time); then, alternating, submits
the spec with `ctxlaunch submit` and applies the rendered folder with `kubectl apply -f`
(server-side for a TrainJob, whose runtime exceeds nothing but is applied as ctxlaunch does),
each in a fresh namespace, and measures from the moment the command is started until the
PyTorchJob (or TrainJob) exists on the server (polled every 10 ms with the kubernetes client) and until the
command returns. ctxlaunch also runs its pre-flight checks (discovery, namespace, two access
reviews, job exists, PodMonitor kind) before it applies: that is part of what is measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SERVICES = Path(os.environ.get("CTXLAUNCH_SERVICES_DIR", "/var/tmp/ctxlaunch-services"))
KUBECONFIG = SERVICES / "kubernetes" / "admin.kubeconfig"
SETS = ["cluster.target=kubernetes", "cluster.kubernetes.image=example/ctxlaunch:1"]


def measure(
    command: list[str],
    env: dict[str, str],
    conn,
    namespace: str,
    name: str,
    kind: str = "PyTorchJob",
) -> dict[str, float]:
    """Seconds from starting `command` until the job exists, and until it returns."""
    from ctxlaunch.launch.backends.kube_jobs import job_path

    exists: list[float] = []
    stop = threading.Event()

    def poll(start: float) -> None:
        while not stop.is_set():
            if conn.get(job_path(namespace, name, kind)) is not None:
                exists.append(time.perf_counter() - start)
                return
            time.sleep(0.01)

    start = time.perf_counter()
    poller = threading.Thread(target=poll, args=(start,), daemon=True)
    poller.start()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    returned = time.perf_counter() - start
    if result.returncode != 0:
        stop.set()
        raise RuntimeError(f"{' '.join(command[:2])} failed: {result.stderr}")
    poller.join(timeout=30)
    stop.set()
    if not exists:
        raise RuntimeError(f"{kind} {namespace}/{name} did not appear")
    return {"exists": exists[0], "returns": returned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--api", choices=["pytorchjob", "trainjob"], default="pytorchjob")
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="keep PYTHONDONTWRITEBYTECODE as the environment has it (the "
        "project's modules then compile from source at every command)",
    )
    args = parser.parse_args()
    from ctxlaunch.launch.backends.kube_connection import Connection
    from ctxlaunch.launch.backends.kube_jobs import JOB_APIS

    kind = JOB_APIS[args.api].kind

    conn = Connection.open(kubeconfig=str(KUBECONFIG))
    kubectl = [str(BIN / "kubectl"), "--kubeconfig", str(KUBECONFIG)]
    results: dict[str, list[dict[str, float]]] = {"ctxlaunch submit": [], "kubectl apply -f": []}
    namespaces = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "CTXLAUNCH_HOME": str(work / "home"), "KUBECONFIG": str(KUBECONFIG)}
        if not args.no_bytecode:
            # As an installed package runs: pip writes the bytecode at install time. (This
            # machine's environment sets PYTHONDONTWRITEBYTECODE, so the project's own modules,
            # installed editable, would otherwise be compiled from source at every command.)
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
            subprocess.run(
                [sys.executable, "-m", "compileall", "-q", str(ROOT / "ctxlaunch")],
                check=True,
                capture_output=True,
                env=env,
            )
        for rep in range(args.reps):
            for how in results:
                namespace = f"bench-{uuid.uuid4().hex[:8]}"
                subprocess.run(
                    kubectl + ["create", "namespace", namespace], check=True, capture_output=True
                )
                namespaces.append(namespace)
                name = f"bench-{rep}"
                sets = SETS + [
                    f"cluster.kubernetes.namespace={namespace}",
                    f"name={name}",
                    f"cluster.kubernetes.api={args.api}",
                ]
                flags = [arg for item in sets for arg in ("--set", item)]
                if how == "ctxlaunch submit":
                    command = [
                        str(BIN / "ctxlaunch"),
                        "submit",
                        str(ROOT / "jobs/demo.yaml"),
                        *flags,
                    ]
                else:
                    out = work / f"{namespace}"
                    subprocess.run(
                        [
                            str(BIN / "ctxlaunch"),
                            "render",
                            str(ROOT / "jobs/demo.yaml"),
                            "-t",
                            "kubernetes",
                            "-o",
                            str(out),
                            *flags,
                        ],
                        check=True,
                        capture_output=True,
                        env=env,
                    )
                    command = kubectl + ["apply", "-f", str(out)]
                    if args.api == "trainjob":
                        command.insert(-2, "--server-side")
                results[how].append(measure(command, env, conn, namespace, name, kind))
    for namespace in namespaces:  # the objects go with it where a controller manager runs
        subprocess.run(
            kubectl
            + [
                "delete",
                f"{JOB_APIS[args.api].resource},configmaps"
                + (",trainingruntimes" if args.api == "trainjob" else ""),
                "--all",
                "-n",
                namespace,
            ],
            capture_output=True,
        )
        subprocess.run(
            kubectl + ["delete", "namespace", namespace, "--wait=false"], capture_output=True
        )
    print(
        f"median of {args.reps} (all runs: seconds), from starting the command; demo spec "
        f"rendered for Kubernetes as a {kind}, same API server"
    )
    print(f"| | {kind} exists | command returns |")
    print("|---|---|---|")
    medians = {}
    for how, runs in results.items():
        medians[how] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = medians[how]
        every = ", ".join(f"{r['exists']:.2f}" for r in runs)
        print(f"| {how} | {m['exists']:.3f} ({every}) | {m['returns']:.3f} |")
    ours, plain = medians["ctxlaunch submit"], medians["kubectl apply -f"]
    print(
        f"| ratio | {ours['exists'] / plain['exists']:.2f}x | "
        f"{ours['returns'] / plain['returns']:.2f}x |"
    )


if __name__ == "__main__":
    main()
