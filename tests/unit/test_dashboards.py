"""The Grafana dashboard and the Prometheus rules: current, built from real metric names, and
checked by promtool (`promtool check rules`, `promtool test rules`).

promtool comes with Debian's prometheus package: `scripts/services/prometheus.sh install`.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ctxlaunch.runtime.telemetry.metrics import BY_NAME
from tests.helpers.devtools import DEV_SCRIPTS, dev_script
from tests.helpers.paths import ROOT
from tests.helpers.promtool import RULE_TESTS, promtool
from tests.helpers.services import SERVICES_ENV

dash = dev_script("grafana_dashboard")

DASHBOARD = ROOT / dash.DEFAULT_OUTPUT
RULES = ROOT / "manifests" / "prometheus" / "ctxlaunch-rules.yml"
REGENERATE = "python scripts/dev/grafana_dashboard.py"

# --------------------------------------------------------------------------------------------
# A small PromQL reader: which metric names an expression selects.

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*|\d[\w.]*")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
    "atan2",
}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, keywords, labels or numbers)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token[0].isdigit() or token.lower() in _KEYWORDS:
            continue
        if text[match.end() :].lstrip().startswith("("):  # a function or an aggregation
            continue
        names.add(token)
    return names


def test_metric_names_reader() -> None:
    assert metric_names('sum by (run) (increase(a_total{job="$job", x=~"b(c)"}[$__range]))') == {
        "a_total"
    }
    assert metric_names("time() - b > 600 and b offset 10m > 0 or on() group_left c") == {"b", "c"}
    assert metric_names("1 - x:y:z / w{a='q'}") == {"x:y:z", "w"}


# --------------------------------------------------------------------------------------------
# The dashboard


@pytest.fixture(scope="module")
def committed() -> dict:
    assert DASHBOARD.is_file(), f"missing {DASHBOARD}; generate it with {REGENERATE}"
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(dashboard: dict) -> list[dict]:
    return list(dash.iter_panels(dashboard))


def by_title(dashboard: dict) -> dict[str, dict]:
    return {panel["title"]: panel for panel in panels(dashboard)}


def test_committed_dashboard_is_current(tmp_path: Path) -> None:
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        pytest.fail(
            "grafana-foundation-sdk is not installed: pip install -e '.[dev]'", pytrace=False
        )
    expected = dash.dashboard_json(dash.build_dashboard())
    actual = DASHBOARD.read_text(encoding="utf-8") if DASHBOARD.is_file() else ""
    if actual != expected:
        diff = difflib.unified_diff(
            actual.splitlines(),
            expected.splitlines(),
            "committed",
            "build_dashboard()",
            lineterm="",
            n=2,
        )
        pytest.fail(
            f"{DASHBOARD.relative_to(ROOT)} is not what build_dashboard() builds; "
            f"regenerate it with `{REGENERATE}` and review the diff:\n"
            + "\n".join(list(diff)[:60]),
            pytrace=False,
        )
    # The command line writes the same bytes.
    out = tmp_path / "dashboard.json"
    dash.main(["--output", str(out)])
    assert out.read_text(encoding="utf-8") == expected


def test_module_imports_without_the_sdk(committed: dict) -> None:
    code = (
        "import sys; sys.modules['grafana_foundation_sdk'] = None\n"
        f"sys.path.insert(0, {str(DEV_SCRIPTS)!r})\n"
        "import json, grafana_dashboard as d\n"
        f"print(len(d.panel_queries(json.load(open({str(DASHBOARD)!r})), {{'job': 'j'}})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == sum(len(p["targets"]) for p in panels(committed))


def test_variables(committed: dict) -> None:
    variables = {v["name"]: v for v in committed["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == "query"
    assert variables["job"]["query"] == "label_values(ctxlaunch_last_step, job)"
    assert variables["run"]["query"] == 'label_values(ctxlaunch_last_step{job="$job"}, run)'
    assert variables["run"]["multi"] and variables["run"]["allValue"] == ".*"
    for name in ("job", "run", "rank"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"


# Title -> (unit, what its queries must contain). The titles are what the README names.
REQUIRED_PANELS = {
    "Last step": ("none", ["ctxlaunch_last_step{"]),
    "Time since last step": ("s", ["time() - ", "ctxlaunch_last_step_timestamp_seconds{"]),
    "MFU, mean over ranks (causal and full conventions)": (
        "percentunit",
        ['convention="causal"', 'convention="full"'],
    ),
    "MFU per rank, causal convention": (
        "percentunit",
        ["ctxlaunch_mfu_ratio{", 'convention="causal"'],
    ),
    "MFU per rank, full convention": ("percentunit", ["ctxlaunch_mfu_ratio{", 'convention="full"']),
    "Tokens/s per GPU": ("short", ["ctxlaunch_tokens_per_second_per_gpu{"]),
    "Achieved TFLOP/s per GPU, causal convention": (
        "flops",
        ["ctxlaunch_model_flops_per_second_per_gpu{", 'convention="causal"'],
    ),
    "Achieved TFLOP/s per GPU, full convention": (
        "flops",
        ["ctxlaunch_model_flops_per_second_per_gpu{", 'convention="full"'],
    ),
    "Step time: measured against predicted": (
        "s",
        [
            "ctxlaunch_step_duration_seconds{",
            "ctxlaunch_predicted_step_duration_seconds{",
            "ctxlaunch_predicted_step_error_ratio{",
        ],
    ),
    "Time left": ("s", ["ctxlaunch_estimated_remaining_seconds{"]),
    "Progress": ("percentunit", ["ctxlaunch_last_step{", "ctxlaunch_target_steps{"]),
    "Loss": ("none", ["ctxlaunch_loss{"]),
    "Memory per rank against capacity": (
        "bytes",
        [
            "ctxlaunch_memory_peak_allocated_bytes{",
            "ctxlaunch_memory_peak_reserved_bytes{",
            "ctxlaunch_memory_capacity_bytes{",
            "ctxlaunch_planner_predicted_peak_bytes{",
        ],
    ),
    "Memory headroom per rank": (
        "percentunit",
        ["1 - ctxlaunch_memory_peak_reserved_bytes{", "/ ctxlaunch_memory_capacity_bytes{"],
    ),
    "OOM events in the time range": ("none", ["increase(ctxlaunch_oom_events_total{"]),
    "OOM events per rank (increase over 5m)": ("none", ["increase(ctxlaunch_oom_events_total{"]),
    "OOM events: step, planner prediction, what would fit": (
        "none",
        ["ctxlaunch_oom_event_info{", "predicted_peak_bytes", "would_fit"],
    ),
    "Exposed ring communication per rank (seconds)": ("s", ["ctxlaunch_cp_exposed_comm_seconds{"]),
    "Exposed ring communication, fraction of step time": (
        "percentunit",
        ["ctxlaunch_cp_exposed_comm_seconds{", "/ ctxlaunch_step_duration_seconds{"],
    ),
    "Attention kernel per rank": (
        "none",
        ["ctxlaunch_attention_kernel_info{", "kernel, chosen_by"],
    ),
    "Expert load per layer (busiest expert / mean routings)": (
        "none",
        ["ctxlaunch_moe_expert_load_ratio{", 'layer!="max"'],
    ),
    "EP rank load against the planned load": (
        "none",
        ["ctxlaunch_moe_ep_rank_load_ratio{", "ctxlaunch_moe_planned_load_ratio{"],
    ),
}


def test_required_panels(committed: dict) -> None:
    found = by_title(committed)
    missing = sorted(set(REQUIRED_PANELS) - set(found))
    assert not missing, f"panels missing from the dashboard: {missing}"
    for title, (unit, fragments) in REQUIRED_PANELS.items():
        panel = found[title]
        assert panel["fieldConfig"]["defaults"]["unit"] == unit, title
        exprs = " ".join(t["expr"] for t in panel["targets"])
        for fragment in fragments:
            assert fragment in exprs, f"{title!r}: no {fragment!r} in {exprs}"


def test_every_query_uses_known_metrics_and_filters_by_job(committed: dict) -> None:
    recorded = {rule["record"] for rule in rules(RULES) if "record" in rule}
    known = set(BY_NAME) | recorded
    for panel in panels(committed):
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = metric_names(expr)
            assert names, f"{panel['title']!r}: no metric in {expr}"
            assert names <= known, f"{panel['title']!r}: unknown metrics {names - known}"
            # Every selector of the query names the job and the runs.
            selectors = re.findall(r"\b[a-z_:]+\{([^}]*)\}", expr)
            assert len(selectors) == len(re.findall(r"\bctxlaunch_\w+\b", expr)), expr
            for selector in selectors:
                assert 'job="$job"' in selector and 'run=~"$run"' in selector, expr


def test_per_rank_series_are_labelled_by_rank(committed: dict) -> None:
    for panel in panels(committed):
        for target in panel["targets"]:
            if panel["type"] == "timeseries" and " by (" not in target["expr"]:
                assert "{{rank}}" in target.get("legendFormat", ""), panel["title"]


def test_panel_queries_substitutes_variables(committed: dict) -> None:
    n_targets = sum(len(panel["targets"]) for panel in panels(committed))
    queries = dash.panel_queries(committed, {"job": "train-8b", "run": "r1|r2", "rank": "0"})
    assert len(queries) == n_targets
    assert [title for title, _ in queries] == [
        panel["title"] for panel in panels(committed) for _ in panel["targets"]
    ]
    for title, query in queries:
        assert "$" not in query, (title, query)
        assert 'job="train-8b", run=~"r1|r2", rank=~"0"' in query, (title, query)
    assert any("[1h]" in query for _, query in queries)  # $__range's default
    # Variables with an "All" option default to it; the job has none.
    defaulted = dash.panel_queries(committed, {"job": "j", "__range": "5m"})
    assert all('run=~".*", rank=~".*"' in query for _, query in defaulted)
    assert any("[5m]" in query for _, query in defaulted)
    with pytest.raises(KeyError, match="job"):
        dash.panel_queries(committed, {})


# --------------------------------------------------------------------------------------------
# The rules


def rules(path: Path) -> list[dict]:
    return [
        rule
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
    ]


def test_rules_use_known_metrics() -> None:
    all_rules = rules(RULES)
    recorded = {rule["record"] for rule in all_rules if "record" in rule}
    assert recorded, "no recording rules"
    for name in recorded:  # level:metric:operations, named after one of our metrics
        level, metric, operation = name.split(":")
        assert level and operation and metric.startswith("ctxlaunch_"), name
    known = set(BY_NAME) | recorded
    for rule in all_rules:
        names = metric_names(rule["expr"])
        assert names, rule
        assert names <= known, f"{rule.get('record') or rule.get('alert')}: {names - known}"


def test_alerts_have_for_severity_and_annotations() -> None:
    alerts = [rule for rule in rules(RULES) if "alert" in rule]
    assert {a["alert"] for a in alerts} == {
        "CtxlaunchOOM",
        "CtxlaunchMFULow",
        "CtxlaunchTrainingStalled",
        "CtxlaunchMemoryHeadroomLow",
        "CtxlaunchExposedCommHigh",
        "CtxlaunchStepDriftedFromPrediction",
        "CtxlaunchExpertCollapse",
        "CtxlaunchExpertLoadOverPlan",
    }
    for alert in alerts:
        name = alert["alert"]
        assert "for" in alert, name
        assert alert["labels"]["severity"] in {"warning", "critical"}, name
        summary = alert["annotations"]["summary"]
        description = alert["annotations"]["description"]
        for text in (summary, description):
            assert "{{ $labels.job }}" in text and "{{ $labels.run }}" in text, name
        # The MFU alert is per run (the mean over ranks), and so are the experts' (every rank
        # exports the run's global routing); the others name the rank.
        if name not in (
            "CtxlaunchMFULow",
            "CtxlaunchExpertCollapse",
            "CtxlaunchExpertLoadOverPlan",
        ):
            assert "{{ $labels.rank }}" in summary and "{{ $labels.rank }}" in description, name
        assert "$value" in description, name
        assert "threshold" in description, name


def test_dashboard_draws_the_alert_thresholds() -> None:
    expr = {rule["alert"]: rule["expr"] for rule in rules(RULES) if "alert" in rule}
    assert f"< {dash.MFU_CAUSAL_MIN}" in expr["CtxlaunchMFULow"]
    assert f"> {dash.EXPERT_COLLAPSE:g}" in expr["CtxlaunchExpertCollapse"]
    assert f"> {dash.STALL_SECONDS}" in expr["CtxlaunchTrainingStalled"]
    assert f"< {dash.MEMORY_HEADROOM_MIN}" in expr["CtxlaunchMemoryHeadroomLow"]
    assert f"> {dash.EXPOSED_COMM_MAX}" in expr["CtxlaunchExposedCommHigh"]


def test_recording_rules_aggregate_as_their_level_says() -> None:
    """`job_run*:` rules aggregate by job and run; `job_run_rank:` rules keep every label."""
    for rule in rules(RULES):
        if "record" not in rule:
            continue
        level = rule["record"].split(":")[0]
        if level == "job_run_rank":
            assert " by (" not in rule["expr"] and " without (" not in rule["expr"], rule
        else:
            labels = level.split("_")
            assert f"by ({', '.join(labels)})" in rule["expr"], rule


# --------------------------------------------------------------------------------------------
# promtool


@pytest.mark.parametrize(
    "args",
    [("check", "rules", RULES), ("test", "rules", RULE_TESTS)],
    ids=["check-rules", "test-rules"],
)
def test_promtool(args: tuple) -> None:
    result = subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, (
        f"promtool {' '.join(map(str, args))} failed:\n{result.stdout}{result.stderr}"
    )


def test_a_missing_promtool_skips_the_fast_loop_and_fails_the_whole_suite(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without promtool the tests above skip, saying how to install it; where scripts/test has
    installed the services they fail instead, so the whole suite cannot skip them silently."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no promtool on it
    monkeypatch.delenv(SERVICES_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="scripts/services/prometheus.sh install"):
        promtool()
    monkeypatch.setenv(SERVICES_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="promtool is not installed"):
        promtool()
