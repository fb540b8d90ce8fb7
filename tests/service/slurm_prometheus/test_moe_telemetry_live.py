"""A mixture of experts' telemetry against the real thing: a local training run of a tiny
Qwen3-MoE at CP 2 x EP 2 pushes to the real Pushgateway; Prometheus has each layer's expert
load and the run's highest, the busiest EP rank's load beside the planned one, the
load-balancing loss apart from the language-model loss, the drops counter, on both ranks with
their labels, and every panel of the dashboard's mixture-of-experts row returns data. Needs the
services of scripts/services (scripts/test starts them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ctxlaunch.runtime.telemetry.metrics import LABELS, METRICS
from tests.helpers.devtools import dev_script
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.services import PUSHGATEWAY_URL, poll, query, require_prometheus

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
DASHBOARD = json.loads((ROOT / "manifests/grafana/ctxlaunch-training.json").read_text())
MOE = [m.name for m in METRICS if m.name.startswith("ctxlaunch_moe_")]

pytestmark = pytest.mark.service_group("prometheus")  # local runs: no Slurm


@pytest.fixture(scope="module", autouse=True)
def prometheus() -> None:
    require_prometheus()


@pytest.mark.timeout(300)
def test_expert_load_series_reach_prometheus(tmp_path: Path) -> None:
    job = f"moe-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [
            CTXLAUNCH,
            "submit",
            str(JOBS / "demo.yaml"),
            *("--set", f"name={job}"),
            *("--set", "model.preset=tiny-qwen3-moe"),
            *("--set", "parallel.ep=2"),
            *("--set", "training.seq_len=1024"),
            *("--set", "training.steps=4"),
            *("--set", "training.checkpoint.dir=null"),
            *("--set", "telemetry.prometheus=push"),
            *("--set", f"telemetry.pushgateway_url={PUSHGATEWAY_URL}"),
            *("--set", "telemetry.push_interval_seconds=1"),
        ],
        cwd=tmp_path,
        env={**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "experts busiest/mean" in result.stdout and "(EP ranks" in result.stdout
    poll(f'ctxlaunch_last_step{{job="{job}"}} == 4', lambda r: len(r) == 2)
    for name in MOE:
        found = query(f'{name}{{job="{job}"}}')
        assert {s["metric"]["rank"] for s in found} == {"0", "1"}, (name, found)
        for sample in found:
            labels = sample["metric"]
            assert set(LABELS) <= set(labels) and labels["cp"] == "2", (name, labels)
    layers = {
        s["metric"]["layer"]: float(s["value"][1])
        for s in query(f'ctxlaunch_moe_expert_load_ratio{{job="{job}", rank="0"}}')
    }
    assert set(layers) == {"0", "1", "max"}
    # The layers' loads are kept to four decimals in metrics.jsonl; the highest is exact.
    assert layers["max"] == pytest.approx(max(layers["0"], layers["1"]), abs=1e-4)
    assert all(1 <= load <= 8 / 2 for load in layers.values())  # at most E / top-k
    (planned,) = query(f'ctxlaunch_moe_planned_load_ratio{{job="{job}", rank="0"}}')
    assert float(planned["value"][1]) == 2.0  # the default: ep, the worst dropless routing
    aux = [float(s["value"][1]) for s in query(f'ctxlaunch_moe_aux_loss{{job="{job}"}}')]
    loss = [float(s["value"][1]) for s in query(f'ctxlaunch_loss{{job="{job}"}}')]
    assert all(a > 0 for a in aux) and aux != loss
    dropped = query(f'ctxlaunch_moe_tokens_dropped_total{{job="{job}"}}')
    assert all(float(s["value"][1]) == 0 for s in dropped)  # dropless
    run = layers and query(f'ctxlaunch_moe_aux_loss{{job="{job}"}}')[0]["metric"]["run"]
    for title, expr in dev_script("grafana_dashboard").panel_queries(
        DASHBOARD, {"job": job, "run": run}
    ):
        if "ctxlaunch_moe_" in expr:
            try:
                poll(expr, timeout=15)
            except AssertionError:
                raise AssertionError(f"dashboard panel {title!r}: no data for {expr}") from None
