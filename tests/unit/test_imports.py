"""The launcher side stays light: `import ctxlaunch` (and everything a login node runs: the CLI,
the spec, the planner, rendering, the Slurm backend's module) imports neither torch nor
kubernetes nor submitit nor DeepSpeed; those load inside the code that needs them."""

from __future__ import annotations

import subprocess
import sys

LAUNCHER_MODULES = [
    "ctxlaunch",
    "ctxlaunch.cli",
    "ctxlaunch.contract.spec",
    "ctxlaunch.contract.spec.fields",
    "ctxlaunch.contract.spec.model_section",
    "ctxlaunch.contract.spec.training_section",
    "ctxlaunch.contract.spec.parallel_section",
    "ctxlaunch.contract.spec.cluster_section",
    "ctxlaunch.contract.spec.rules",
    "ctxlaunch.contract.spec.schema",
    "ctxlaunch.contract.parallel_dims",
    "ctxlaunch.contract.loader",
    "ctxlaunch.contract.rundir",
    "ctxlaunch.contract.events",
    "ctxlaunch.perf.layout",
    "ctxlaunch.perf.memory",
    "ctxlaunch.perf.activations",
    "ctxlaunch.perf.modelstates",
    "ctxlaunch.perf.peakphases",
    "ctxlaunch.perf.profiles",
    "ctxlaunch.perf.flops",
    "ctxlaunch.perf.steptime",
    "ctxlaunch.perf.machine",
    "ctxlaunch.perf.commvolume",
    "ctxlaunch.planning.plan",
    "ctxlaunch.planning.advise",
    "ctxlaunch.launch.request",
    "ctxlaunch.launch.render",
    "ctxlaunch.launch.sweep",
    "ctxlaunch.launch.jobstore",
    "ctxlaunch.launch.backends",
    "ctxlaunch.launch.backends.local",
    "ctxlaunch.launch.backends.slurm",
    "ctxlaunch.launch.backends.kubernetes",
    "ctxlaunch.launch.backends.kube_connection",
    "ctxlaunch.launch.backends.kube_jobs",
    "ctxlaunch.launch.backends.kube_preflight",
    "ctxlaunch.launch.backends.kube_apply",
    "ctxlaunch.launch.backends.kube_states",
    "ctxlaunch.launch.backends.kube_logs",
    "ctxlaunch.runtime.podentry",
    "ctxlaunch.runtime.records",
    "ctxlaunch.runtime.calibration.job",
    "ctxlaunch.runtime.telemetry.metrics",
]
HEAVY = ["torch", "kubernetes", "submitit", "deepspeed"]


def test_launcher_modules_import_no_heavy_dependency() -> None:
    code = (
        f"import sys\nfor m in {LAUNCHER_MODULES!r}: __import__(m)\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"imported at module level: {result.stdout.strip()}"


def test_cp_needs_nothing_but_torch() -> None:
    code = (
        "import sys\nimport ctxlaunch.cp\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('ctxlaunch'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    modules = set(result.stdout.strip().split(","))
    assert {m for m in modules if not m.startswith("ctxlaunch.cp")} == {"ctxlaunch"}, modules


def test_backend_base_imports_no_backend() -> None:
    """The registry lives in ctxlaunch.launch.backends; the base knows none of its subclasses, and a
    backend's module loads only when its target is used."""
    code = (
        "import sys\nimport ctxlaunch.launch.backends\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('ctxlaunch.launch.backends.'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "ctxlaunch.launch.backends.base"


def test_the_cli_builds_no_spec_models_until_a_command_reads_a_spec() -> None:
    """Building the spec's pydantic models is the largest part of the CLI's start-up
    (BENCHMARKS.md, submit latency: Kubernetes submit): importing the CLI (all `--help`) does not
    pay for it; a command that reads a spec does, in the loader (and the backends, which import
    the spec, still do)."""
    code = (
        "import sys\nimport ctxlaunch.cli\n"
        "print(','.join(m for m in ('pydantic', 'ctxlaunch.contract.spec') if m in sys.modules))"
        "\nfrom ctxlaunch.contract.loader import validate_spec\n"
        "try:\n    validate_spec({})\nexcept ValueError:\n    pass\n"
        "print('ctxlaunch.contract.spec' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True"], result.stdout
