"""The experiment trackers (telemetry.trackers): TensorBoard, MLflow and W&B written by the real
trainer through their real libraries, and read back with each library's own reader
(TensorBoard's EventAccumulator, MLflow's client on its file store, the W&B offline run's
records through wandb's protobuf messages). Nothing leaves the machine: MLflow writes a file
store, W&B runs offline, and the trainer's HTTP(S) proxy is a closed local port."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from ctxlaunch.contract.loader import apply_overrides, read_spec_data, validate_spec
from tests.helpers.paths import JOBS, ROOT, free_port
from tests.helpers.specs import make, problems

# One worker for the module: its trained run (a module fixture, the trainer with every tracker)
# is then made once, not once on each worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("trackers")

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
SECRET = "s3cret-value-never-logged"
TRACKERS = "telemetry.trackers=[{kind: tensorboard}, {kind: mlflow}, {kind: wandb}]"
TINY_WITH_EVAL = [
    "name=trk-demo",
    "parallel.cp=1",
    "cluster.gpus_per_node=1",
    "training.seq_len=512",
    "training.steps=4",
    "training.log_interval=2",
    "training.checkpoint.interval=1000",
    "training.data.source=text",
    f"training.data.path={ROOT / 'README.md'}",
    "training.eval.interval=2",
    "training.eval.sequences=2",
    "training.eval.buckets=3",
    "training.eval.passkey.lengths=[320, 512]",
    "training.eval.passkey.depths=[0.0, 0.5]",
    "training.eval.passkey.trials=1",
    f"fabric.env={{TRACKER_TEST_SECRET: {SECRET}}}",
]
"""jobs/demo.yaml cut to one rank, 4 steps of 512 tokens logged every 2, an evaluation (buckets
and a 2 x 2 passkey grid) every 2, and a fabric.env value that no tracker may record."""


def offline_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a trainer that must not reach the network."""
    env = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")}
    for name in (
        "WANDB_API_KEY",
        "MLFLOW_TRACKING_URI",
        "CTXLAUNCH_INJECT_FAULT",
        "CTXLAUNCH_RUN_ID",
        "CTXLAUNCH_JOB_ID",
        "SLURM_JOB_ID",
    ):
        env.pop(name, None)
    dead = f"http://127.0.0.1:{free_port()}"
    env.update(
        # One rank without torchrun rendezvouses on MASTER_PORT: a port of its own, never the
        # default that another test's job may hold.
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        HTTP_PROXY=dead,
        HTTPS_PROXY=dead,
        http_proxy=dead,
        https_proxy=dead,
        NO_PROXY="",
    )
    return env


def write_spec(tmp_path: Path, overrides: list[str]) -> Path:
    data = apply_overrides(
        read_spec_data(JOBS / "demo.yaml"),
        [*overrides, f"training.checkpoint.dir={tmp_path / 'ckpt'}"],
    )
    validate_spec(data)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    return path


def train(tmp_path: Path, overrides: list[str], *, prelude: str = "", timeout: float = 240):
    """One rank of the trainer on demo.yaml with `overrides`, run dir tmp_path/run; `prelude`
    runs first in the trainer's process."""
    spec = write_spec(tmp_path, overrides)
    code = (
        f"{prelude}\nimport sys\nfrom ctxlaunch.runtime.trainer.main import main\n"
        f"sys.exit(main([{str(spec)!r}, '--run-dir', {str(tmp_path / 'run')!r}]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tracker_lines(text: str) -> list[str]:
    """The lines the trackers said (on stderr)."""
    return [line for line in text.splitlines() if "ctxlaunch telemetry: tracker" in line]


# -- reading the W&B offline run back ----------------------------------------------------------

WANDB_BLOCK = 32768
"""The .wandb file is a LevelDB-style log: a 7-byte header (':W&B', magic 0xBEE1, version 0),
then 32 KiB blocks of chunks, each a 7-byte header (CRC-32 of type and data, length, type: 1
full, 2 first, 3 middle, 4 last) and data; each record is a wandb_internal_pb2.Record."""


def wandb_records(path: Path) -> list[Any]:
    """Every record of a .wandb file, parsed with wandb's own protobuf messages (wandb 0.31 has
    no Python reader of its own; the framing is checked chunk by chunk)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        left = WANDB_BLOCK - position % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad chunk at {position}"
        position += 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(directory: Path) -> dict[str, Any]:
    """The one offline run under `directory`/wandb: its run record, config, history rows by
    step and exit code."""
    (run_file,) = (directory / "wandb").glob("offline-run-*/run-*.wandb")
    found: dict[str, Any] = {"config": {}, "history": {}, "exit_code": None}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["run"] = record.run
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        else:
            updates = []
        for item in updates:
            found["config"][item.key] = json.loads(item.value_json)
        if kind == "history":
            row = found["history"].setdefault(record.history.step.num, {})
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        if kind == "exit":
            found["exit_code"] = record.exit.exit_code
    return found


# -- the spec ----------------------------------------------------------------------------------


def test_no_tracker_by_default_and_each_kind_has_its_defaults() -> None:
    assert validate_spec(make()).telemetry.trackers == []
    spec = validate_spec(
        make(**{"telemetry.trackers": "[{kind: tensorboard}, {kind: mlflow}, {kind: wandb}]"})
    )
    assert [t.model_dump() for t in spec.telemetry.trackers] == [
        {"kind": "tensorboard", "log_dir": None},
        {"kind": "mlflow", "tracking_uri": None, "experiment": None, "run_name": None},
        {"kind": "wandb", "project": None, "entity": None, "mode": "offline", "dir": None},
    ]


@pytest.mark.parametrize(
    ("trackers", "path", "reason"),
    [
        ("[{kind: comet}]", "telemetry.trackers[0]", "kind: tensorboard, mlflow or wandb"),
        ("[{log_dir: x}]", "telemetry.trackers[0]", "kind: tensorboard, mlflow or wandb"),
        ("[{kind: tensorboard, log_dir: ' '}]", "log_dir", "an empty path"),
        ("[{kind: mlflow, tracking_uri: ./mlruns}]", "tracking_uri", "file:<path>"),
        ("[{kind: mlflow, experiment: ''}]", "experiment", "an empty name"),
        ("[{kind: wandb, project: 'a/b'}]", "project", "not a W&B name"),
        ("[{kind: wandb, entity: 'my team'}]", "entity", "not a W&B name"),
        ("[{kind: wandb, mode: cloud}]", "mode", "'offline' or 'online'"),
        ("[{kind: wandb, projekt: x}]", "projekt", "unknown field"),
        ("[{kind: wandb}, {kind: wandb, mode: online}]", "telemetry.trackers", "at most once"),
    ],
)
def test_bad_tracker_settings_name_the_field_and_the_reason(trackers, path, reason) -> None:
    found = problems(make(**{"telemetry.trackers": trackers}))
    (where,) = found
    assert where.startswith("telemetry.trackers") and where.endswith(path), found
    assert reason in found[where]


# -- the series --------------------------------------------------------------------------------


def sample_series() -> dict[str, float]:
    from ctxlaunch.runtime.records import Bucket, EvalResult, PasskeyCell, StepMetrics
    from ctxlaunch.runtime.telemetry.trackers import eval_series, step_series

    metrics = StepMetrics(3, 2.5, 0.5, 1000.0, 2.0, 1.5, 2**30, 1e-3, 0.7, 0.01)
    step = step_series(
        metrics,
        mfu={"full": 0.4, "causal": 0.3},
        peak_allocated_bytes=2**31,
        peak_reserved_bytes=3 * 2**30,
        predicted_peak_bytes=2**32,
    )
    result = EvalResult(
        step=3,
        sequences=1,
        tokens=512,
        loss=2.0,
        perplexity=math.exp(2.0),
        buckets=[Bucket(0, 256, 256, 2.5, 12.2), Bucket(256, 512, 0, 0.0, 1.0)],
        passkey=[PasskeyCell(512, 0.125, 2, 1, 0.5), PasskeyCell(512, 1.0, 2, 2, 1.0)],
    )
    return {**step, **eval_series(result)}


def test_series_names_suit_every_tracker() -> None:
    series = sample_series()
    # W&B sorts and filters on names of letters, digits and '_' (sections split by '/').
    part = r"[_a-zA-Z][_a-zA-Z0-9]*"
    assert all(re.fullmatch(rf"{part}(/{part})*", name) for name in series), series
    # An MLflow file store keeps a/b as a file: no name may be a section of another.
    assert not [a for a in series for b in series if b.startswith(a + "/")]
    assert series["memory/peak_over_predicted"] == 0.5
    assert series["memory/predicted_peak_gib"] == 4.0
    assert series["eval_loss_by_length/len_0_256"] == 2.5
    assert "eval_loss_by_length/len_256_512" not in series  # no token scored there
    assert series["eval_passkey/len_512_depth_12p5"] == 0.5
    assert series["eval_passkey/len_512_depth_100"] == 1.0
    assert series["eval/passkey_accuracy"] == 0.75


def test_the_trackers_libraries_load_only_when_a_tracker_starts() -> None:
    code = (
        "import sys\nimport ctxlaunch.runtime.telemetry.training\n"
        "print(','.join(m for m in ('wandb', 'mlflow', 'tensorboard', "
        "'torch.utils.tensorboard') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


# -- the real trainer, one rank, all three trackers --------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The run directory of the tiny job trained with all three trackers."""
    tmp_path = tmp_path_factory.mktemp("trackers")
    done = train(tmp_path, [*TINY_WITH_EVAL, TRACKERS])
    assert done.returncode == 0, done.stdout + done.stderr
    assert tracker_lines(done.stderr) == [], done.stderr  # every tracker started
    return tmp_path / "run"


def expected(run: Path) -> tuple[list[dict], list[dict]]:
    """What the trainer logged itself: metrics.jsonl (the logged steps) and eval.jsonl."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4] and [e["step"] for e in evals] == [2, 4]
    return metrics, evals


def predicted_peak_gib() -> float:
    from ctxlaunch.contract.hardware import GiB
    from ctxlaunch.perf.layout import Layout
    from ctxlaunch.perf.memory import estimate

    spec = validate_spec(
        apply_overrides(read_spec_data(JOBS / "demo.yaml"), [*TINY_WITH_EVAL, TRACKERS])
    )
    return estimate(spec.model, Layout.from_spec(spec), spec.cluster.gpu_info).total / GiB


def check_series(by_step: dict[int, dict[str, float]], run: Path) -> None:
    """The series of each logged step and evaluation, as a tracker recorded them, against what
    the trainer logged (float32 where TensorBoard stores them)."""
    metrics, evals = expected(run)
    assert sorted(by_step) == [2, 4]
    for logged, result in zip(metrics, evals, strict=True):
        row = by_step[logged["step"]]
        assert row["train/loss"] == pytest.approx(logged["loss"], rel=1e-6)
        assert row["train/lr"] == pytest.approx(logged["lr"], rel=1e-6)
        assert row["train/grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-6)
        assert row["train/tokens_per_second_per_gpu"] == pytest.approx(
            logged["tokens_per_second_per_gpu"], rel=1e-6
        )
        # Both conventions over the same peak: their ratio is the FLOP counts'.
        assert row["train/mfu_causal"] / row["train/mfu_full"] == pytest.approx(
            logged["model_tflops_per_gpu_causal"] / logged["model_tflops_per_gpu_full"], rel=1e-5
        )
        assert row["memory/predicted_peak_gib"] == pytest.approx(predicted_peak_gib(), rel=1e-6)
        # Read after the step: the process's peak RSS only grows.
        assert row["memory/peak_allocated_gib"] * 2**30 >= logged["peak_memory_bytes"] * (1 - 1e-6)
        assert row["eval/loss"] == pytest.approx(result["loss"], rel=1e-6)
        scored = [b for b in result["buckets"] if b["tokens"]]
        assert len(scored) == 3
        for bucket in scored:
            name = f"eval_loss_by_length/len_{bucket['start']}_{bucket['stop']}"
            assert row[name] == pytest.approx(bucket["loss"], rel=1e-6)
        cells = result["passkey"]
        assert len(cells) == 4
        for cell in cells:
            name = f"eval_passkey/len_{cell['length']}_depth_{cell['depth'] * 100:g}"
            assert row[name] == cell["retrieved"] / cell["trials"]


@pytest.mark.timeout(300)
def test_tensorboard_event_files_hold_the_steps_evaluations_and_config(trained: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(trained / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    by_step: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            by_step.setdefault(event.step, {})[tag] = event.value
    check_series(by_step, trained)
    (text,) = events.Tensors("config/text_summary")
    config = make_ndarray(text.tensor_proto).item().decode()
    assert config.startswith("```json\n")
    spec = json.loads(config.removeprefix("```json\n").removesuffix("\n```"))
    assert spec["name"] == "trk-demo" and spec["training"]["seq_len"] == 512
    assert spec["derived"]["tokens_per_step"] == 512
    assert SECRET not in config and "TRACKER_TEST_SECRET" in spec["fabric"]["env"]


@pytest.mark.timeout(300)
def test_mlflow_file_store_holds_the_metrics_and_the_spec_as_params(
    trained: Path, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to file stores
    client = MlflowClient(tracking_uri=(trained / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("trk-demo")  # the job name by default
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "trk-demo"
    by_step: dict[int, dict[str, float]] = {}
    for name in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, name):
            by_step.setdefault(metric.step, {})[name] = metric.value
    check_series(by_step, trained)
    params = run.data.params
    assert params["training.seq_len"] == "512" and params["model.preset"] == "tiny"
    assert params["training.eval.passkey.depths"] == "[0.0, 0.5]"
    assert params["derived.global_batch"] == "1"
    assert params["fabric.env.TRACKER_TEST_SECRET"] != SECRET
    assert SECRET not in json.dumps(params)


@pytest.mark.timeout(300)
def test_wandb_offline_run_holds_the_history_and_the_spec_as_config(trained: Path) -> None:
    found = wandb_run(trained)
    assert found["run"].project == "trk-demo" and found["run"].display_name == "trk-demo"
    history = {
        step: {k: v for k, v in row.items() if not k.startswith("_")}
        for step, row in found["history"].items()
    }
    check_series(history, trained)
    config = found["config"]
    assert config["training"]["seq_len"] == 512 and config["derived"]["world_size"] == 1
    assert SECRET not in json.dumps(config)
    assert found["exit_code"] == 0


# -- trackers that cannot start or that fail -------------------------------------------------


@pytest.mark.timeout(300)
def test_trackers_that_cannot_start_say_so_once_and_training_goes_on(tmp_path: Path) -> None:
    """TensorBoard's log_dir lies under a regular file, MLflow's server does not listen, and the
    wandb library is hidden (None in sys.modules: `import wandb` fails as if not installed)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    trackers = (
        f"telemetry.trackers=[{{kind: tensorboard, log_dir: {blocker / 'tb'}}}, "
        f"{{kind: mlflow, tracking_uri: 'http://127.0.0.1:{free_port()}'}}, {{kind: wandb}}]"
    )
    overrides = [o for o in TINY_WITH_EVAL if not o.startswith("training.eval.interval")]
    done = train(
        tmp_path,
        [*overrides, "training.steps=2", trackers],
        prelude="import sys\nsys.modules['wandb'] = None",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    lines = tracker_lines(done.stderr)
    assert len(lines) == 3, done.stderr
    tensorboard, mlflow, wandb = lines
    assert "tracker tensorboard not started" in tensorboard and "log_dir" in tensorboard
    assert "tracker mlflow not started" in mlflow and "unreachable" in mlflow
    assert "tracker wandb not started" in wandb and "pip install 'ctxlaunch[wandb]'" in wandb
    assert all(line.startswith("[rank 0] ") and "goes on" in line for line in lines)
    assert not (tmp_path / "run" / "wandb").exists()


@pytest.mark.timeout(120)
def test_a_tracker_that_fails_mid_run_is_reported_once_and_dropped(
    tmp_path: Path, monkeypatch
) -> None:
    """MLflow's file store is deleted under a running tracker (its next write fails for real);
    TensorBoard beside it keeps every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ctxlaunch.runtime.telemetry.trackers import MlflowWriter, TensorBoardWriter, Trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    mlflow = MlflowWriter(store.as_uri(), "exp", "run", {"name": "job"})
    tensorboard = TensorBoardWriter(tmp_path / "tb", {"name": "job"})
    said: list[str] = []
    trackers = Trackers([mlflow, tensorboard], say=said.append)
    shutil.rmtree(store)
    trackers.log({"train/loss": 3.0}, 1)  # queued: MLflow's thread fails on it
    deadline = time.monotonic() + 60
    while mlflow.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mlflow.error is not None
    for step in (2, 3):
        trackers.log({"train/loss": 3.0 - step}, step)
    trackers.close(0)
    assert len(said) == 1, said
    assert "tracker mlflow failed at step 1: " in said[0] and "does not exist" in said[0]
    assert said[0].endswith("; disabled, training goes on")
    assert trackers.writers == []
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 3.0),
        (2, 1.0),
        (3, 0.0),
    ]


# -- two ranks through the local target --------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_only_rank_0_writes_the_trackers(tmp_path: Path, monkeypatch) -> None:
    sets = [
        "training.steps=2",
        "training.seq_len=512",
        "training.log_interval=1",
        f"training.checkpoint.dir={tmp_path / 'ckpt'}",
        TRACKERS,
    ]
    done = subprocess.run(
        [CTXLAUNCH, "submit", str(JOBS / "demo.yaml"), *[a for s in sets for a in ("--set", s)]],
        cwd=tmp_path,
        env=offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert tracker_lines(done.stderr) == [], done.stderr
    (run,) = sorted((tmp_path / "home" / "jobs").iterdir())
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    found = wandb_run(run)  # exactly one offline run
    assert sorted(found["history"]) == [1, 2] and found["config"]["derived"]["world_size"] == 2
    assert found["run"].display_name.startswith("demo-")  # the job name and ctxlaunch's run id
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("demo")
    assert experiment is not None
    (only,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(only.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2]
