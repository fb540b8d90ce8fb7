"""`render --monitoring` for Kubernetes: the job's PrometheusRule (the committed rules, scoped to
the job) and the dashboard's ConfigMap for Grafana's sidecar. Golden files, a YAML round trip,
the committed dashboard byte for byte, every committed rule with its expression, the
PrometheusRule against the operator CRD's schema (tests/helpers/prometheus_operator.py), and
promtool's own tests of the rules run on the scoped copy. The real API server takes both in
tests/service/kubernetes_api/test_monitoring.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from ctxlaunch.contract.loader import load_spec
from ctxlaunch.launch.monitoring import (
    DASHBOARD_MANIFEST,
    RULES_MANIFEST,
    MonitoringError,
    MonitoringOptions,
    rule_groups,
    scope_expr,
)
from ctxlaunch.launch.render import render_files
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.prometheus_operator import prometheusrule_schema
from tests.helpers.promtool import RULE_TESTS, promtool

EXAMPLE = JOBS / "llama3-70b-1m-k8s.yaml"
"""A scrape-mode Kubernetes example: its goldens sit beside its PodMonitor's."""
RULES_FILE = "monitoring/llama3-70b-1m-rules.yaml"
DASHBOARD_FILE = "monitoring/ctxlaunch-dashboard.yaml"


def monitored(*sets: str, options: MonitoringOptions | None = None) -> dict[str, str]:
    return render_files(
        load_spec(EXAMPLE, list(sets)), "kubernetes", monitoring=options or MonitoringOptions()
    )


def only_doc(text: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(text) if d]
    return doc


def committed_rules() -> list[dict]:
    return yaml.safe_load((ROOT / RULES_MANIFEST).read_text())["groups"]


def test_monitoring_goldens(check_golden) -> None:
    """The two files beside the PodMonitor; the job's own files are what they are without."""
    files = monitored()
    plain = render_files(load_spec(EXAMPLE), "kubernetes")
    assert sorted(files) == sorted([*plain, RULES_FILE, DASHBOARD_FILE])
    assert {name: files[name] for name in plain} == plain
    check_golden(f"llama3-70b-1m-k8s/{RULES_FILE}", files[RULES_FILE])
    check_golden(f"llama3-70b-1m-k8s/{DASHBOARD_FILE}", files[DASHBOARD_FILE])


def test_both_round_trip_through_yaml() -> None:
    files = monitored()
    for name in (RULES_FILE, DASHBOARD_FILE):
        doc = only_doc(files[name])
        assert only_doc(yaml.safe_dump(doc)) == doc
        assert yaml.safe_load(json.dumps(doc)) == doc


def test_the_prometheus_rule_is_labelled_and_placed_like_the_pod_monitor() -> None:
    files = monitored("cluster.kubernetes.namespace=team-a")
    rule = only_doc(files[RULES_FILE])
    monitor = only_doc(files["monitoring/llama3-70b-1m-podmonitor.yaml"])
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"] == {
        "name": "llama3-70b-1m-rules",
        "namespace": "team-a",
        "labels": monitor["metadata"]["labels"],
    }


def test_the_dashboard_config_map_carries_the_committed_dashboard() -> None:
    config_map = only_doc(monitored()[DASHBOARD_FILE])
    assert (config_map["apiVersion"], config_map["kind"]) == ("v1", "ConfigMap")
    assert config_map["metadata"] == {
        "name": "ctxlaunch-dashboard",
        "namespace": "llm-training",
        "labels": {"app.kubernetes.io/name": "ctxlaunch", "grafana_dashboard": "1"},
    }
    committed = (ROOT / DASHBOARD_MANIFEST).read_text(encoding="utf-8")
    assert config_map["data"] == {"ctxlaunch-training.json": committed}
    assert json.loads(config_map["data"]["ctxlaunch-training.json"])["uid"] == "ctxlaunch-training"


def test_the_dashboard_is_one_per_namespace_whichever_job_renders_it() -> None:
    """Every job writes the same ConfigMap: no job label, no job name in it."""
    assert monitored()[DASHBOARD_FILE] == monitored("name=another-job")[DASHBOARD_FILE]


def test_the_dashboard_label_and_namespace_can_be_set() -> None:
    options = MonitoringOptions(
        dashboard_label=("grafana.example/dashboard", "ctxlaunch"), dashboard_namespace="grafana"
    )
    meta = only_doc(monitored(options=options)[DASHBOARD_FILE])["metadata"]
    assert meta["namespace"] == "grafana"
    assert meta["labels"] == {
        "app.kubernetes.io/name": "ctxlaunch",
        "grafana.example/dashboard": "ctxlaunch",
    }


def unscoped(expr: str, job: str) -> str:
    return expr.replace(f'{{job="{job}"}}', "").replace(f'job="{job}", ', "")


def test_every_committed_rule_is_there_with_its_expression_scoped_to_the_job() -> None:
    rendered = only_doc(monitored()[RULES_FILE])["spec"]["groups"]
    committed = committed_rules()
    assert [g["name"] for g in rendered] == [g["name"] for g in committed]
    for ours, theirs in zip(rendered, committed):
        assert len(ours["rules"]) == len(theirs["rules"])
        for rule, source in zip(ours["rules"], theirs["rules"]):
            assert unscoped(rule["expr"], "llama3-70b-1m") == source["expr"]
            assert {k: v for k, v in rule.items() if k != "expr"} == {
                k: v for k, v in source.items() if k != "expr"
            }
            # Every metric the expression selects carries the job's matcher.
            metrics = re.findall(r"[A-Za-z_:]*ctxlaunch_[A-Za-z0-9_:]*", source["expr"])
            assert rule["expr"].count('job="llama3-70b-1m"') == len(metrics) > 0


def test_the_prometheus_rule_validates_against_the_operator_schema() -> None:
    validator = jsonschema.Draft7Validator(prometheusrule_schema())
    rule = only_doc(monitored()[RULES_FILE])
    errors = sorted(validator.iter_errors(rule), key=str)
    assert not errors, "\n".join(f"{e.message} at {'/'.join(map(str, e.path))}" for e in errors)
    # The schema really refuses what the operator would (so the check above means something).
    rule["spec"]["groups"][1]["rules"][0]["for"] = "ten minutes"
    rule["spec"]["groups"][0]["rules"][0]["keep_firing_for"] = "5m"
    messages = " ".join(e.message for e in validator.iter_errors(rule))
    assert "ten minutes" in messages and "keep_firing_for" in messages


@pytest.mark.parametrize(
    "expr,scoped",
    [
        ("ctxlaunch_a", 'ctxlaunch_a{job="j"}'),
        ('ctxlaunch_a{x="1"}', 'ctxlaunch_a{job="j", x="1"}'),
        ('ctxlaunch_a {x="1"}', 'ctxlaunch_a {job="j", x="1"}'),
        ("rate(ctxlaunch_a[5m]) offset 1h", 'rate(ctxlaunch_a{job="j"}[5m]) offset 1h'),
        ("ctxlaunch_a offset 10m", 'ctxlaunch_a{job="j"} offset 10m'),
        ("a:ctxlaunch_b:avg > 0.5", 'a:ctxlaunch_b:avg{job="j"} > 0.5'),
        ("sum by (job, run) (x)", "sum by (job, run) (x)"),
        ('up{name="ctxlaunch_a"}', 'up{name="ctxlaunch_a"}'),
        ("other_metric + ctxlaunch_a", 'other_metric + ctxlaunch_a{job="j"}'),
    ],
)
def test_scope_expr(expr: str, scoped: str) -> None:
    assert scope_expr(expr, "j") == scoped


def promtool_tests_on_the_rendered_rules(job: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """promtool's unit tests of the rules (tests/promtool, whose series are all job train-8b)
    run on the groups of the PrometheusRule rendered for `job`."""
    rule = only_doc(monitored(f"name={job}")[f"monitoring/{job}-rules.yaml"])
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = ["rules.yml"]
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run(
        [promtool(), "test", "rules", "rules.test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_the_scoped_rules_pass_promtools_tests_for_their_job(tmp_path: Path) -> None:
    result = promtool_tests_on_the_rendered_rules("train-8b", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_scoped_rules_ignore_another_jobs_series(tmp_path: Path) -> None:
    """Rendered for another job, the same tests fail: nothing is recorded and no alert fires
    on train-8b's series."""
    result = promtool_tests_on_the_rendered_rules("other-job", tmp_path)
    assert result.returncode != 0
    assert "CtxlaunchOOM" in result.stdout + result.stderr


def test_telemetry_push_has_them_too() -> None:
    files = monitored("telemetry.prometheus=push", "telemetry.pushgateway_url=http://pg:9091")
    assert RULES_FILE in files and DASHBOARD_FILE in files
    assert "monitoring/llama3-70b-1m-podmonitor.yaml" not in files


@pytest.mark.parametrize(
    "target,sets,words",
    [
        ("kubernetes", ['telemetry.prometheus="off"'], "telemetry.prometheus is off"),
        ("slurm", ["cluster.target=slurm"], "are Kubernetes objects; the target is slurm"),
    ],
)
def test_monitoring_is_refused_where_it_cannot_work(
    target: str, sets: list[str], words: str
) -> None:
    spec = load_spec(EXAMPLE, sets)
    with pytest.raises(MonitoringError, match=re.escape(words)):
        render_files(spec, target, monitoring=MonitoringOptions())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options,field",
    [
        ({"dashboard_label": ("grafana dashboard", "1")}, "dashboard_label"),
        ({"dashboard_label": ("grafana_dashboard", "-1")}, "dashboard_label"),
        ({"dashboard_namespace": "Grafana"}, "dashboard_namespace"),
    ],
)
def test_bad_options_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(MonitoringError, match=f"^{field}: "):
        MonitoringOptions(**options)


def test_a_rule_field_the_template_does_not_write_is_refused() -> None:
    text = "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: up\n        keep_firing_for: 5m\n"
    with pytest.raises(MonitoringError, match=r"groups\[0\]\.rules\[0\].*keep_firing_for"):
        rule_groups(text, "j")


def test_render_monitoring_writes_both_beside_the_pod_monitor(tmp_path: Path) -> None:
    """`ctxlaunch render --monitoring -o DIR` writes the PrometheusRule and the dashboard's
    ConfigMap under monitoring/, and on a Slurm target it is bad input that writes nothing."""
    from ctxlaunch.cli import app
    from tests.helpers.cli import CliRunner

    runner = CliRunner()
    spec = str(JOBS / "llama3-70b-1m-k8s.yaml")
    result = runner.invoke(app, ["render", spec, "--monitoring", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in (tmp_path / "out" / "monitoring").iterdir())
    assert written == [
        "ctxlaunch-dashboard.yaml",
        "llama3-70b-1m-podmonitor.yaml",
        "llama3-70b-1m-rules.yaml",
    ]
    refused = runner.invoke(
        app,
        [
            "render",
            str(JOBS / "demo.yaml"),
            "-t",
            "slurm",
            "--monitoring",
            "-o",
            str(tmp_path / "s"),
        ],
    )
    assert refused.exit_code == 2 and "the target is slurm" in refused.output
    assert not (tmp_path / "s").exists()
