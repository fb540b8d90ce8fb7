"""Telemetry against the real thing: local training runs (CP 2, ring) export to a real
Prometheus, by scrape and by Pushgateway; every metric arrives with its labels and plausible
values, every dashboard query returns data, and an injected OOM shows up as the event, the
counter and the exit status. Needs the services of scripts/services (scripts/test starts them)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ctxlaunch.runtime.telemetry.metrics import LABELS, METRICS
from tests.helpers.devtools import dev_script
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.services import (
    PUSHGATEWAY_URL,
    add_scrape_targets,
    poll,
    query,
    require_prometheus,
)

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
DASHBOARD = json.loads((ROOT / "manifests/grafana/ctxlaunch-training.json").read_text())
# Not from every run: an event's series (metrics.Metric.event), which exist once it happened:
# the OOM's (the OOM test covers it), the evaluation's (tests/unit/test_eval.py covers them,
# these runs do not evaluate) and a re-plan's (tests/unit/test_local.py's healing run); and a
# mixture-of-experts model's (test_moe_telemetry_live.py runs one).
EVENTS = tuple(m.name for m in METRICS if m.event)
MOE_ONLY = tuple(m.name for m in METRICS if m.experts)
ALWAYS = [m.name for m in METRICS if not m.event and m.name not in MOE_ONLY]

pytestmark = pytest.mark.service_group("prometheus")  # local runs: no Slurm


@pytest.fixture(scope="module", autouse=True)
def prometheus() -> None:
    require_prometheus()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def command(tmp_path: Path, name: str, *sets: str) -> list[str]:
    args = [
        CTXLAUNCH,
        "submit",
        str(JOBS / "demo.yaml"),
        "--set",
        f"name={name}",
        "--set",
        "training.seq_len=1024",
        "--set",
        "training.checkpoint.dir=null",
    ]
    for item in sets:
        args += ["--set", item]
    return args


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    out = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home"), **extra}
    if "CTXLAUNCH_INJECT_FAULT" not in extra:
        out.pop("CTXLAUNCH_INJECT_FAULT", None)
    return out


def free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def series_by_rank(name: str, job: str, extra: str = "") -> dict[str, dict]:
    result = query(f'{name}{{job="{job}"{extra}}}')
    return {r["metric"]["rank"]: r for r in result}


def check_every_metric(job: str) -> str:
    """Every always-present metric for ranks 0 and 1, with the identity and layout labels;
    returns the run label."""
    runs = set()
    for name in ALWAYS:
        found = series_by_rank(name, job)
        assert set(found) == {"0", "1"}, (name, found)
        for sample in found.values():
            labels = sample["metric"]
            assert set(LABELS) <= set(labels), (name, labels)
            assert labels["job"] == job and labels["cp"] == "2"
            assert labels["cp_algorithm"] == "ring" and labels["seq_len"] == "1024"
            assert labels["model"] == "tiny" and labels["node"] == socket.gethostname()
            runs.add(labels["run"])
    assert len(runs) == 1
    return runs.pop()


def check_values(job: str) -> None:
    def values(name: str, extra: str = "") -> list[float]:
        return [float(s["value"][1]) for s in series_by_rank(name, job, extra).values()]

    for convention in ("full", "causal"):
        mfu = values("ctxlaunch_mfu_ratio", f', convention="{convention}"')
        assert len(mfu) == 2 and all(0 < v <= 1 for v in mfu), (convention, mfu)
    full = values("ctxlaunch_mfu_ratio", ', convention="full"')
    causal = values("ctxlaunch_mfu_ratio", ', convention="causal"')
    assert all(f > c for f, c in zip(sorted(full), sorted(causal)))
    assert all(v > 0 for v in values("ctxlaunch_tokens_per_second_per_gpu"))
    assert all(v > 0 for v in values("ctxlaunch_step_duration_seconds"))
    capacity = values("ctxlaunch_memory_capacity_bytes")
    peaks = values("ctxlaunch_memory_peak_allocated_bytes")
    assert all(0 < p < c for p, c in zip(peaks, capacity))
    assert all(v > 0 for v in values("ctxlaunch_planner_predicted_peak_bytes"))
    assert all(v >= 0 for v in values("ctxlaunch_cp_exposed_comm_seconds"))
    assert values("ctxlaunch_oom_events_total") == [0.0, 0.0]
    assert all(0 < v < 20 for v in values("ctxlaunch_loss"))
    sources = {
        s["metric"]["source"] for s in query(f'ctxlaunch_peak_flops_per_second{{job="{job}"}}')
    }
    assert sources == {"measured_cpu_matmul"}  # stated as such on the CPU
    # The prediction and the time left, beside the measured figures.
    assert all(v > 0 for v in values("ctxlaunch_predicted_step_duration_seconds"))
    assert all(v > 0 for v in values("ctxlaunch_predicted_tokens_per_second_per_gpu"))
    assert all(v >= 0 for v in values("ctxlaunch_predicted_step_error_ratio"))
    assert all(v >= 0 for v in values("ctxlaunch_estimated_remaining_seconds"))
    assert values("ctxlaunch_replans_total", ', why="oom"') == [0.0, 0.0]  # served at 0


def check_dashboard(job: str, run: str) -> None:
    for title, expr in dev_script("grafana_dashboard").panel_queries(
        DASHBOARD, {"job": job, "run": run}
    ):
        if any(name in expr for name in EVENTS):
            continue  # an event's panel: empty until it happens (see EVENTS)
        if "ctxlaunch_predicted_step_error_ratio" in expr and not query(
            f'ctxlaunch_predicted_step_error_ratio{{job="{job}"}} > 0'
        ):
            continue  # the error band: none where the error is not known on this machine
        if any(name in expr for name in MOE_ONLY):
            continue  # a dense model (test_moe_telemetry_live.py runs a mixture of experts)
        # Range functions (increase) need two scrapes of the series: poll, briefly.
        try:
            poll(expr, timeout=15)
        except AssertionError:
            raise AssertionError(f"dashboard panel {title!r}: no data for {expr}") from None


def run_push_job(
    tmp_path: Path,
    job: str,
    *,
    steps: int,
    url: str = PUSHGATEWAY_URL,
    interval: float = 1,
    **extra_env: str,
) -> subprocess.CompletedProcess:
    """A local training run (CP 2 ring) pushing its metrics, to the end."""
    return subprocess.run(
        command(
            tmp_path,
            job,
            f"training.steps={steps}",
            "telemetry.prometheus=push",
            f"telemetry.pushgateway_url={url}",
            f"telemetry.push_interval_seconds={interval}",
        ),
        cwd=tmp_path,
        env=env(tmp_path, **extra_env),
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.timeout(240)
def test_scrape_mode_exports_every_metric(tmp_path: Path) -> None:
    job = unique("scrape")
    port = free_port_pair()
    targets = add_scrape_targets(job, [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    process = subprocess.Popen(
        command(
            tmp_path,
            job,
            "training.steps=2000",
            "telemetry.prometheus=scrape",
            f"telemetry.port={port}",
        ),
        cwd=tmp_path,
        env=env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        poll(f'ctxlaunch_last_step{{job="{job}"}} >= 3', lambda r: len(r) == 2, timeout=90)
        run = check_every_metric(job)
        check_values(job)
        check_dashboard(job, run)
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # a preemption: ranks stop after the step
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        targets.unlink(missing_ok=True)


@pytest.mark.timeout(240)
def test_push_mode_exports_every_metric_and_the_final_values(tmp_path: Path) -> None:
    job = unique("push")
    result = run_push_job(tmp_path, job, steps=5)
    assert result.returncode == 0, result.stdout + result.stderr
    # The last push happens at exit: Prometheus sees step 5 of 5 for both ranks.
    poll(f'ctxlaunch_last_step{{job="{job}"}} == 5', lambda r: len(r) == 2)
    run = check_every_metric(job)
    check_values(job)
    assert {
        s["metric"]["rank"]: float(s["value"][1])
        for s in query(f'ctxlaunch_target_steps{{job="{job}"}}')
    } == {"0": 5.0, "1": 5.0}
    check_dashboard(job, run)


@pytest.mark.timeout(240)
def test_injected_oom_is_exported_with_the_layout_and_the_exit_status(tmp_path: Path) -> None:
    job = unique("oom")
    result = run_push_job(tmp_path, job, steps=20, CTXLAUNCH_INJECT_FAULT="kind=oom,rank=1,step=3")
    assert result.returncode == 86, result.stdout + result.stderr
    assert "out of memory on rank 1 at step 3: the planner predicted" in result.stderr
    assert "would fit with" in result.stderr
    counter = poll(f'ctxlaunch_oom_events_total{{job="{job}", rank="1"}} == 1')
    assert counter[0]["metric"]["cp"] == "2" and counter[0]["metric"]["cp_algorithm"] == "ring"
    (event,) = poll(f'ctxlaunch_oom_event_info{{job="{job}"}}')
    labels = event["metric"]
    assert labels["rank"] == "1" and labels["step"] == "3" and labels["seq_len"] == "1024"
    assert int(labels["predicted_peak_bytes"]) > 0 and int(labels["capacity_bytes"]) > 0
    assert labels["would_fit"]
    # The dashboard's OOM table now has its row.
    run = labels["run"]
    table = [
        (t, q)
        for t, q in dev_script("grafana_dashboard").panel_queries(
            DASHBOARD, {"job": job, "run": run}
        )
        if "ctxlaunch_oom_event_info" in q
    ]
    assert table and all(query(q) for _, q in table)


@pytest.mark.timeout(180)
def test_an_unreachable_pushgateway_never_stops_training(tmp_path: Path) -> None:
    job = unique("nopush")
    result = run_push_job(tmp_path, job, steps=5, url="http://127.0.0.1:9", interval=0.2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ctxlaunch: done: 5 steps" in result.stdout
    # Logged once (rank 0's stderr streams to the console), not once per attempt.
    assert result.stderr.count("cannot push to http://127.0.0.1:9") == 1, result.stderr
