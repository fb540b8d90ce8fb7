"""A job's monitoring on Kubernetes, beside its PodMonitor: the Prometheus rules as a Prometheus
Operator PrometheusRule, and the Grafana dashboard as a ConfigMap for Grafana's dashboard
sidecar. Both come from the committed files (`manifests/prometheus/ctxlaunch-rules.yml`,
`manifests/grafana/ctxlaunch-training.json`); this module turns them into what the templates
fill in, and render.py renders them.

The rules are scoped to the job: every metric an expression selects gets the matcher
`job="<name>"` (the exporter's own `job` label, which the PodMonitor's honorLabels and the
Pushgateway's grouping key both keep). Each job brings its own PrometheusRule, named after it.
Verbatim, N jobs' copies of the same recording rules would write the same series N times over,
and each copy of an alert would fire for every job's series; scoped, a job's PrometheusRule
records and alerts on that job's series alone and can be deleted with it.

The dashboard is not per job: it picks the job with its own `job` variable. So the ConfigMap is
one per namespace, named `ctxlaunch-dashboard` whichever job renders it, without the job's label:
applying it again for another job changes nothing, and Grafana never sees two copies of one
dashboard uid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ctxlaunch.contract.shipped import ShippedFileMissing, shipped

RULES_MANIFEST = "manifests/prometheus/ctxlaunch-rules.yml"
DASHBOARD_MANIFEST = "manifests/grafana/ctxlaunch-training.json"
DASHBOARD_CONFIG_MAP = "ctxlaunch-dashboard"
GRAFANA_SIDECAR_LABEL = ("grafana_dashboard", "1")
"""The label Grafana's dashboard sidecar watches by default (the Grafana Helm chart's
sidecar.dashboards.label and labelValue, as kube-prometheus-stack sets them)."""
RULE_KEYS = frozenset({"alert", "record", "expr", "for", "labels", "annotations"})
"""The rule fields the PrometheusRule template writes (the upstream CRD's Rule, less
keep_firing_for, which the committed rules do not use)."""
GROUP_KEYS = frozenset({"name", "interval", "rules"})

_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class MonitoringError(ValueError):
    """The monitoring objects cannot be rendered: the field or file at fault, and why."""


@dataclass(frozen=True)
class MonitoringOptions:
    """What `render --monitoring` adds to a Kubernetes job's files, and where the dashboard
    goes."""

    dashboard_label: tuple[str, str] = GRAFANA_SIDECAR_LABEL
    """The label (key, value) the cluster's Grafana sidecar selects dashboard ConfigMaps by."""
    dashboard_namespace: str | None = None
    """The dashboard ConfigMap's namespace: by default the job's. The Grafana chart's sidecar
    watches only Grafana's own namespace unless its searchNamespace says otherwise."""

    def __post_init__(self) -> None:
        key, value = self.dashboard_label
        if not _LABEL_KEY.fullmatch(key):
            raise MonitoringError(
                f"dashboard_label: {key!r} is not a Kubernetes label key "
                "([prefix/]name, the name up to 63 letters, digits, '-', '_' or '.')"
            )
        if not _LABEL_VALUE.fullmatch(value):
            raise MonitoringError(
                f"dashboard_label: {value!r} is not a Kubernetes label value "
                "(up to 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric)"
            )
        if self.dashboard_namespace is not None and not _NAMESPACE.fullmatch(
            self.dashboard_namespace
        ):
            raise MonitoringError(
                f"dashboard_namespace: {self.dashboard_namespace!r} is not a namespace name "
                "(an RFC 1123 label: lowercase letters, digits and '-', at most 63)"
            )


@dataclass(frozen=True)
class Rule:
    """One recording or alerting rule, its expression scoped to the job."""

    kind: Literal["alert", "record"]
    name: str
    expr: str
    for_: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RuleGroup:
    name: str
    rules: list[Rule]
    interval: str | None = None


@dataclass(frozen=True)
class PrometheusRuleRequest:
    """What the PrometheusRule is made of."""

    name: str
    namespace: str
    labels: dict[str, str]
    """The PodMonitor's labels: a Prometheus that selects one selects the other alike."""
    job: str
    source: str
    """The rule file the groups come from, named in the object's header."""
    groups: list[RuleGroup]


@dataclass(frozen=True)
class DashboardRequest:
    """What the dashboard's ConfigMap is made of."""

    name: str
    namespace: str
    labels: dict[str, str]
    sidecar_selector: str
    """The label the sidecar selects by, as `key=value`."""
    key: str
    """The data key: the dashboard file's name, the file the sidecar writes for Grafana."""
    dashboard_json: str
    """The committed dashboard, byte for byte."""
    source: str


def read_shipped(what: str) -> str:
    """A shipped monitoring file ("alerts" or "dashboard", contract.shipped), from the installed
    package or the checkout; MonitoringError when this installation has none."""
    try:
        return shipped(what).read_text(encoding="utf-8")
    except (ShippedFileMissing, OSError) as exc:
        raise MonitoringError(f"the monitoring objects cannot be rendered: {exc}") from None


_PROMQL = re.compile(
    # A string literal is left as it is; an identifier not inside a longer name or a number may
    # be a metric, with the opening of its label matchers if it has them.
    r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|`[^`]*`"
    r"|(?<![A-Za-z0-9_:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\{)?"
)


def is_ctxlaunch_metric(name: str) -> bool:
    """ctxlaunch's series are all `ctxlaunch_*` (runtime/telemetry/metrics.py) and its recording
    rules `level:ctxlaunch_*:operation`; no label, function or keyword has such a name."""
    return name.startswith("ctxlaunch_") or ":ctxlaunch_" in name


def scope_expr(expr: str, job: str) -> str:
    """`expr` with the matcher job="<job>" on every ctxlaunch metric it selects: added to the
    metric's matchers, or as its only one. Functions (a name before `(`) are left alone."""
    matcher = f'job="{job}"'

    def scoped(match: re.Match[str]) -> str:
        name, brace = match.group(1), match.group(2)
        if name is None or not is_ctxlaunch_metric(name):
            return match.group(0)
        if expr[match.end() :].lstrip().startswith("("):
            return match.group(0)
        return f"{name}{brace}{matcher}, " if brace else f"{name}{{{matcher}}}"

    return _PROMQL.sub(scoped, expr)


def rule_groups(rules_text: str, job: str, source: str = RULES_MANIFEST) -> list[RuleGroup]:
    """The groups of a Prometheus rule file, each rule's expression scoped to `job`. A field the
    template would not write is refused rather than dropped."""
    data = yaml.safe_load(rules_text)
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise MonitoringError(f"{source}: not a Prometheus rule file (no `groups:` list)")
    groups = []
    for index, group in enumerate(data["groups"]):
        where = f"{source}: groups[{index}]"
        unknown = sorted(set(group) - GROUP_KEYS)
        if unknown:
            raise MonitoringError(f"{where}: fields the PrometheusRule does not carry: {unknown}")
        rules = [_rule(rule, job, f"{where}.rules[{i}]") for i, rule in enumerate(group["rules"])]
        groups.append(RuleGroup(name=group["name"], rules=rules, interval=group.get("interval")))
    return groups


def _rule(rule: dict[str, Any], job: str, where: str) -> Rule:
    unknown = sorted(set(rule) - RULE_KEYS)
    if unknown:
        raise MonitoringError(f"{where}: fields the PrometheusRule does not carry: {unknown}")
    if ("alert" in rule) == ("record" in rule):
        raise MonitoringError(f"{where}: a rule has exactly one of `alert` and `record`")
    kind: Literal["alert", "record"] = "alert" if "alert" in rule else "record"
    return Rule(
        kind=kind,
        name=rule[kind],
        expr=scope_expr(str(rule["expr"]), job),
        for_=rule.get("for"),
        labels={str(k): str(v) for k, v in (rule.get("labels") or {}).items()},
        annotations={str(k): str(v) for k, v in (rule.get("annotations") or {}).items()},
    )


def prometheus_rule_request(
    job: str, namespace: str, labels: dict[str, str], rules_text: str
) -> PrometheusRuleRequest:
    """The job's PrometheusRule, `<job>-rules` in the job's namespace, from a rule file's text."""
    return PrometheusRuleRequest(
        name=f"{job}-rules",
        namespace=namespace,
        labels=dict(labels),
        job=job,
        source=RULES_MANIFEST,
        groups=rule_groups(rules_text, job),
    )


def dashboard_request(
    job_namespace: str, options: MonitoringOptions, dashboard_json: str
) -> DashboardRequest:
    """The dashboard's ConfigMap from the dashboard file's text, kept byte for byte."""
    key, value = options.dashboard_label
    return DashboardRequest(
        name=DASHBOARD_CONFIG_MAP,
        namespace=options.dashboard_namespace or job_namespace,
        labels={"app.kubernetes.io/name": "ctxlaunch", key: value},
        sidecar_selector=f"{key}={value}",
        key=Path(DASHBOARD_MANIFEST).name,
        dashboard_json=dashboard_json,
        source=DASHBOARD_MANIFEST,
    )
