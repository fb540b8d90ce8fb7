"""A job's monitoring objects (`render --monitoring`) against the real kube-apiserver of
scripts/services/kubernetes.sh: the dashboard's ConfigMap, and the PrometheusRule under the
Prometheus Operator's CRD.

That server has no Prometheus Operator and no package here ships its CRDs, so the test installs
tests/helpers/prometheus_operator.py's PrometheusRule CRD, which reproduces the upstream schema
of the fields ctxlaunch writes (names, durations' pattern, int-or-string expr, string maps),
for the duration of the test, as test_kubernetes.py does with its PodMonitor stand-in. The
server then validates the rendered object against that schema, structurally as the operator's
CRD would; the rules' PromQL is promtool's to check (tests/unit/test_render_monitoring.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from ctxlaunch.contract.loader import load_spec
from ctxlaunch.launch.monitoring import DASHBOARD_MANIFEST, MonitoringOptions
from ctxlaunch.launch.render import render_files
from tests.helpers.kube_api import IMAGE, contains, get, kubectl
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.prometheus_operator import PROMETHEUSRULE_CRD
from tests.helpers.services import require_kubernetes

CRD_NAME = PROMETHEUSRULE_CRD["metadata"]["name"]


@pytest.fixture(scope="module", autouse=True)
def kube() -> None:
    require_kubernetes()


def wait_until(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        time.sleep(0.5)


@pytest.fixture
def prometheusrule_crd() -> Iterator[None]:
    """The stand-in CRD, established, and deleted again afterwards."""
    kubectl("apply", "-f", "-", stdin=json.dumps(PROMETHEUSRULE_CRD))
    try:
        wait_until(
            lambda: (
                kubectl(
                    "wait",
                    "--for=condition=Established",
                    "--timeout=2s",
                    f"crd/{CRD_NAME}",
                    check=False,
                ).returncode
                == 0
            ),
            "the stand-in PrometheusRule CRD established",
        )
        yield
    finally:
        kubectl("delete", "crd", CRD_NAME, "--wait=false")
        wait_until(
            lambda: kubectl("get", "crd", CRD_NAME, check=False).returncode != 0,
            "the stand-in PrometheusRule CRD deleted",
        )


def render_monitoring(tmp_path: Path, namespace: str) -> Path:
    """What `render --monitoring --output DIR` writes for the demo job in `namespace`."""
    spec = load_spec(
        JOBS / "demo.yaml",
        [
            "cluster.target=kubernetes",
            f"cluster.kubernetes.image={IMAGE}",
            f"cluster.kubernetes.namespace={namespace}",
            "name=watched",
            "telemetry.prometheus=scrape",
        ],
    )
    out = tmp_path / "rendered"
    for name, text in render_files(spec, "kubernetes", monitoring=MonitoringOptions()).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return out


def test_without_the_operator_only_the_dashboard_goes_in(namespace: str, tmp_path: Path) -> None:
    """Where no Prometheus Operator is installed the PrometheusRule has no kind to go to; the
    dashboard's ConfigMap is a core object and goes in all the same."""
    kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=false")
    wait_until(
        lambda: kubectl("get", "crd", CRD_NAME, check=False).returncode != 0,
        "no PrometheusRule CRD left from an earlier run",
    )
    out = render_monitoring(tmp_path, namespace)
    refused = kubectl(
        "apply", "--dry-run=server", "-f", str(out / "monitoring/watched-rules.yaml"), check=False
    )
    # The words depend on kubectl's discovery cache; the failure does not.
    assert refused.returncode != 0 and "prometheusrule" in refused.stderr.lower(), refused.stderr
    dry = kubectl(
        "apply", "--dry-run=server", "-f", str(out / "monitoring/ctxlaunch-dashboard.yaml")
    )
    assert "(server dry run)" in dry.stdout


def test_the_server_takes_the_prometheus_rule_and_the_dashboard(
    namespace: str, tmp_path: Path, prometheusrule_crd: None
) -> None:
    out = render_monitoring(tmp_path, namespace)
    rules, dashboard = (
        out / "monitoring/watched-rules.yaml",
        out / "monitoring/ctxlaunch-dashboard.yaml",
    )
    dry = kubectl("apply", "--dry-run=server", "-f", str(rules), "-f", str(dashboard))
    assert dry.stdout.count("(server dry run)") == 2, dry.stdout
    assert get("prometheusrule", namespace, "watched-rules") is None
    kubectl("apply", "-f", str(rules), "-f", str(dashboard))
    (rendered,) = yaml.safe_load_all(rules.read_text())
    stored = get("prometheusrule", namespace, "watched-rules")
    assert stored is not None
    contains(stored["spec"], rendered["spec"])
    assert stored["metadata"]["labels"]["ctxlaunch/job"] == "watched"
    config_map = get("configmap", namespace, "ctxlaunch-dashboard")
    assert config_map is not None and config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    committed = (ROOT / DASHBOARD_MANIFEST).read_text(encoding="utf-8")
    assert config_map["data"] == {"ctxlaunch-training.json": committed}
    kubectl("delete", "-f", str(rules), "-f", str(dashboard))
    assert get("prometheusrule", namespace, "watched-rules") is None


def test_the_server_refuses_a_rule_the_operator_would_refuse(
    namespace: str, tmp_path: Path, prometheusrule_crd: None
) -> None:
    """The stand-in's schema is enforced: a `for` that is not a Prometheus duration is refused
    (so the acceptance above means something)."""
    out = render_monitoring(tmp_path, namespace)
    (rule,) = yaml.safe_load_all((out / "monitoring/watched-rules.yaml").read_text())
    rule["spec"]["groups"][1]["rules"][0]["for"] = "ten minutes"
    bad = kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(rule), check=False)
    assert bad.returncode != 0 and "ten minutes" in bad.stderr, bad.stderr
