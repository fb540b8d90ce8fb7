"""Launch request -> artifact text (an sbatch script, a PyTorchJob manifest, and on request a
job's monitoring objects). Pure: no I/O but reading the templates and the committed monitoring
files.

Safety is enforced, not hoped for: every `{{ ... }}` in a template must pass through a quoting
filter (`sh` for bash, `yaml` for YAML, `envname`/`sbatch` for the validated bits, `comment`
inside a comment line, `code` for shell the request built from ctxlaunch's constants) or be a
number; anything else fails the render. So a job name or an env value carrying `$(...)`,
quotes, newlines or `'; rm` either never validates or lands inert.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import jinja2

from ctxlaunch import __version__
from ctxlaunch.contract.rundir import TRAINING, JobEntry
from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.launch.monitoring import (
    DASHBOARD_CONFIG_MAP,
    MonitoringError,
    MonitoringOptions,
    dashboard_request,
    prometheus_rule_request,
    read_shipped,
)
from ctxlaunch.launch.request import (
    KubernetesRequest,
    ShellCode,
    SlurmRequest,
    kubernetes_request,
    slurm_request,
)

Target = Literal["slurm", "kubernetes"]
TEMPLATES: dict[Target, str] = {"slurm": "slurm.sbatch.j2", "kubernetes": "pytorchjob.yaml.j2"}
SUFFIXES: dict[Target, str] = {"slurm": ".sbatch", "kubernetes": ".yaml"}
TRAINJOB_TEMPLATE = "trainjob.yaml.j2"
"""cluster.kubernetes.api: trainjob (same pod template as the PyTorchJob's, _pod.yaml.j2)."""
MONITOR_TEMPLATE = "podmonitor.yaml.j2"
RULES_TEMPLATE = "prometheusrule.yaml.j2"
DASHBOARD_TEMPLATE = "dashboard-configmap.yaml.j2"
MONITORING_DIR = "monitoring"
"""The PodMonitor (and with `monitoring`, the PrometheusRule and the dashboard's ConfigMap) go
to this subfolder of the output: `kubectl apply -f DIR` (not recursive) leaves them out, so a
cluster without the Prometheus Operator's CRDs takes the job cleanly; `kubectl apply -R -f DIR`
applies them too."""

_SBATCH_DIRECTIVE = re.compile(r"^--[a-z][a-z-]*(=[A-Za-z0-9_.:@%/\-]+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RenderError(RuntimeError):
    """A template tried to emit a value that is not quoted for its destination (a bug)."""


class Quoted(str):
    """Text already made safe for where a template puts it."""


_SHELL_PLAIN = re.compile(r"^[A-Za-z0-9_./:@%+,-]+$")


_LINE_BREAKING = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")
"""Characters that would end a line or a C string inside a script (the spec refuses them in
every value; this keeps any other source from carrying one in)."""


def shell_quote(value: Any) -> Quoted:
    """A single bash word: plain when it holds only characters bash never interprets,
    otherwise single-quoted (inside which nothing is expanded). A control character is a
    RenderError: even quoted, a line break makes one value two lines of the script."""
    text = str(value)
    if _LINE_BREAKING.search(text):
        raise RenderError(f"a value for a script holds a control character: {text[:80]!r}")
    if _SHELL_PLAIN.fullmatch(text):
        return Quoted(text)
    if re.search(r"\\(?='|$)", text):
        # A backslash before a quote or at the end is fine inside single quotes, but reads
        # like a mistaken escape (shellcheck SC1003): double quotes, with \ " $ ` escaped.
        return Quoted('"' + re.sub(r'([\\"$`])', r"\\\1", text) + '"')
    return Quoted("'" + text.replace("'", "'\"'\"'") + "'")


def yaml_quote(value: Any) -> Quoted:
    """JSON is YAML: strings come out double-quoted with every control character escaped, and
    mappings and lists in flow style. Characters beyond ASCII are escaped YAML's way: JSON
    writes one above U+FFFF as a surrogate pair (two \\u escapes), which a YAML reader takes
    for two lone surrogates; YAML's \\U escape holds the whole code point."""
    text = json.dumps(value, ensure_ascii=False)
    return Quoted(_NON_ASCII.sub(_yaml_escape, text))


_NON_ASCII = re.compile(r"[^\x00-\x7e]")


def _yaml_escape(match: re.Match[str]) -> str:
    point = ord(match.group())
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def comment(value: Any) -> Quoted:
    """Text inside a `#` comment line: emitted as it is, a RenderError when it could end the
    line (where the rest would run as a command, or hide the #SBATCH lines below it)."""
    text = str(value)
    if _LINE_BREAKING.search(text):
        raise RenderError(f"a comment would be broken by a control character: {text[:80]!r}")
    return Quoted(text)


def env_name(value: Any) -> Quoted:
    if not isinstance(value, str) or not _ENV_NAME.fullmatch(value):
        raise RenderError(f"not an environment variable name: {value!r}")
    return Quoted(value)


def sbatch_directive(value: Any) -> Quoted:
    if not isinstance(value, str) or not _SBATCH_DIRECTIVE.fullmatch(value):
        raise RenderError(f"not a safe sbatch directive: {value!r}")
    return Quoted(value)


def shell_code(value: Any) -> Quoted:
    """A shell fragment the request built from ctxlaunch's own constants (never from the spec):
    emitted as it is, and refused when it is any other string."""
    if not isinstance(value, ShellCode):
        raise RenderError(f"not shell code built by the request: {value!r}")
    return Quoted(value)


def _finalize(value: Any) -> Any:
    if isinstance(value, Quoted):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise RenderError(
        f"template emitted an unquoted value {value!r}: pass it through a "
        "quoting filter (sh, yaml, envname, sbatch, comment, code)"
    )


def templates_dir() -> Path:
    """The templates: inside the installed package (wheel), else the source tree's templates/."""
    packaged = resources.files("ctxlaunch") / "templates"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "templates"


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        finalize=_finalize,
    )
    env.filters.update(
        sh=shell_quote,
        yaml=yaml_quote,
        envname=env_name,
        sbatch=sbatch_directive,
        code=shell_code,
        comment=comment,
    )
    return env


def artifact_name(spec: JobSpec, target: Target) -> str:
    return spec.name + SUFFIXES[target]


def monitor_name(job_name: str) -> str:
    """Where the PodMonitor goes, relative to the output directory (scrape mode only)."""
    return f"{MONITORING_DIR}/{job_name}-podmonitor.yaml"


def rules_name(job_name: str) -> str:
    """Where the job's PrometheusRule goes, relative to the output directory."""
    return f"{MONITORING_DIR}/{job_name}-rules.yaml"


def dashboard_name() -> str:
    """Where the dashboard's ConfigMap goes, relative to the output directory: one name for
    every job, as the ConfigMap is one per namespace."""
    return f"{MONITORING_DIR}/{DASHBOARD_CONFIG_MAP}.yaml"


def render(spec: JobSpec, target: Target) -> str:
    """The main artifact for `target` as text (the sbatch script; the ConfigMap and
    PyTorchJob)."""
    return render_files(spec, target)[artifact_name(spec, target)]


def render_files(
    spec: JobSpec,
    target: Target,
    sweep: str | None = None,
    entry: JobEntry = TRAINING,
    monitoring: MonitoringOptions | None = None,
) -> dict[str, str]:
    """Every file `render --output DIR` writes, by path relative to DIR: the main artifact and,
    for Kubernetes in scrape mode, the PodMonitor in its own subfolder. `sweep` labels a
    sweep's Kubernetes objects; `entry` is what the job runs (the trainer). With `monitoring`
    (Kubernetes, telemetry on), the job's PrometheusRule and the dashboard's ConfigMap go to
    the same subfolder; MonitoringError says why they cannot."""
    name = artifact_name(spec, target)
    if monitoring is not None:
        check_monitoring(spec, target)
    if target == "slurm":
        return {name: render_request(slurm_request(spec, entry=entry), target, name)}
    request = kubernetes_request(spec, sweep=sweep, entry=entry)
    files = {name: render_request(request, target, name)}
    if request.metrics_ports:
        monitor = monitor_name(spec.name)
        files[monitor] = (
            _environment()
            .get_template(MONITOR_TEMPLATE)
            .render(request=request, version=__version__, filename=monitor)
        )
    if monitoring is not None:
        files.update(render_monitoring(request, monitoring))
    return files


def check_monitoring(spec: JobSpec, target: Target) -> None:
    """The monitoring objects are Prometheus Operator and Grafana sidecar objects, for a job
    that exports metrics: refused, naming the field, for any other."""
    if target != "kubernetes":
        raise MonitoringError(
            f"monitoring: the PrometheusRule and the dashboard's ConfigMap are Kubernetes objects; "
            f"the target is {target}"
        )
    if spec.telemetry.prometheus == "off":
        raise MonitoringError(
            "monitoring: telemetry.prometheus is off, so the job exports no metrics for the rules "
            "and the dashboard to read; set telemetry.prometheus to scrape or push"
        )


def render_monitoring(request: KubernetesRequest, options: MonitoringOptions) -> dict[str, str]:
    """The job's PrometheusRule and the dashboard's ConfigMap, by path in the output."""
    rules = prometheus_rule_request(
        request.name, request.namespace, request.labels, read_shipped("alerts")
    )
    dashboard = dashboard_request(request.namespace, options, read_shipped("dashboard"))
    env = _environment()
    rules_file, dashboard_file = rules_name(request.name), dashboard_name()
    return {
        rules_file: env.get_template(RULES_TEMPLATE).render(
            rules=rules, version=__version__, filename=rules_file
        ),
        dashboard_file: env.get_template(DASHBOARD_TEMPLATE).render(
            dashboard=dashboard, version=__version__, filename=dashboard_file
        ),
    }


def render_request(request: SlurmRequest | KubernetesRequest, target: Target, filename: str) -> str:
    """Fill the target's template with a request (the Slurm backend renders its own request)."""
    template = _environment().get_template(
        TRAINJOB_TEMPLATE
        if isinstance(request, KubernetesRequest) and request.api == "trainjob"
        else TEMPLATES[target]
    )
    return template.render(
        request=request,
        version=__version__,
        filename=filename,
        monitor_filename=monitor_name(request.name)
        if isinstance(request, KubernetesRequest)
        else None,
    )
