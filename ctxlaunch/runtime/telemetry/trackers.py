"""The experiment trackers rank 0 writes (`telemetry.trackers`): TensorBoard, MLflow and
Weights & Biases, fed by the trainer's observers (`TrainingTelemetry.on_step`, `on_eval`), so
nothing is measured twice.

Every tracker gets the same series under the same names. `/` puts a series in a section (a
TensorBoard tag group, a W&B panel section, an MLflow metric folder); names use only letters,
digits, `_` and `/` (what W&B can sort and filter on), and no name is a section of another (an
MLflow file store keeps `a/b` as a file, so `a/b/c` could not sit beside it).

Each logged step (every training.log_interval steps and the last), at that step:

    train/loss                       mean next-token loss of the global batch
    train/lr                         learning rate
    train/grad_norm                  gradient norm before clipping
    train/step_seconds               the step's wall time
    train/tokens_per_second_per_gpu
    train/mfu_full                   MFU, attention FLOPs over the full square
    train/mfu_causal                 MFU, attention FLOPs over the causal half
    train/cp_exposed_comm_seconds    CP communication the step waited for
    train/cp_attention_balance       the CP group's busiest over mean attention area
    train/moe_aux_loss               a mixture of experts' load-balancing loss (before its
                                     coefficient), apart from train/loss
    train/moe_expert_load            busiest expert over mean routings, the highest layer's
    train/moe_ep_rank_load           busiest EP rank over the EP group's mean routings
    train/moe_tokens_dropped         routings dropped over capacity (0 when dropless)
    memory/peak_allocated_gib        rank 0's peak (CUDA allocated; the process RSS on a CPU)
    memory/peak_reserved_gib         rank 0's peak reserved by the allocator
    memory/predicted_peak_gib        the planner's predicted peak per rank
    memory/peak_over_predicted       peak allocated / predicted peak

Each evaluation (training.eval.interval), at its step:

    eval/loss, eval/perplexity                 over every held-out token
    eval/passkey_accuracy                      probes retrieved over the whole grid
    eval_loss_by_length/len_<start>_<stop>     loss of the tokens whose context length is in
                                               [start, stop) (the evaluation's buckets)
    eval_passkey/len_<length>_depth_<percent>  share of the probes at that prompt length and
                                               needle depth (percent; 12.5 -> 12p5) retrieved

At the start, the run's configuration: the resolved spec and the batch figures derived from it
(`derived`: world size, dp, grad_accum, global_batch, tokens_per_step), with the values of
fabric.env left out (it may carry credentials): TensorBoard, a text summary `config` (JSON);
MLflow, the run's parameters, named by dotted path (`training.optimizer.lr`); W&B, the run's
config.

A tracker's library is imported only when the tracker is configured, at the start of the run on
rank 0. A tracker that cannot start (library missing, directory not writable, server
unreachable) is reported once on stderr and left out; one that fails later is reported once and
closed; training goes on either way.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.hardware import GiB
from ctxlaunch.contract.spec.trackers_section import (
    MlflowTrackerSpec,
    TensorBoardTrackerSpec,
    TrackerSpec,
    WandbTrackerSpec,
)

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.records import EvalResult, StepMetrics

CLOSE_TIMEOUT_SECONDS = 30.0
"""How long closing waits for a tracker's queued writes (MLflow's thread) before giving up."""
CONNECT_TIMEOUT_SECONDS = 5.0
"""How long starting an MLflow tracker waits to reach its tracking server."""
MLFLOW_PARAMS_PER_BATCH = 100
"""MLflow's limit on parameters per log_batch call."""
MLFLOW_PARAM_CHARS = 6000
"""MLflow's limit on a parameter value's length."""
REDACTED = "<not logged>"


# -- what is logged --------------------------------------------------------------------------


def step_series(
    metrics: StepMetrics,
    *,
    mfu: Mapping[str, float],
    peak_allocated_bytes: int,
    peak_reserved_bytes: int,
    predicted_peak_bytes: int,
) -> dict[str, float]:
    """One logged step's series: `metrics` as the trainer measured it, `mfu` per convention
    (full, causal) and the memory figures as TrainingTelemetry read them."""
    return {
        "train/loss": metrics.loss,
        "train/lr": metrics.lr,
        "train/grad_norm": metrics.grad_norm,
        "train/step_seconds": metrics.step_seconds,
        "train/tokens_per_second_per_gpu": metrics.tokens_per_second_per_gpu,
        "train/mfu_full": mfu["full"],
        "train/mfu_causal": mfu["causal"],
        "train/cp_exposed_comm_seconds": metrics.exposed_comm_seconds,
        "train/cp_attention_balance": metrics.attention_balance,
        **(
            {
                "train/moe_aux_loss": metrics.aux_loss,
                "train/moe_expert_load": metrics.expert_load,
                "train/moe_ep_rank_load": metrics.expert_rank_load,
                "train/moe_tokens_dropped": float(metrics.tokens_dropped),
            }
            if metrics.expert_load_layers
            else {}
        ),
        "memory/peak_allocated_gib": peak_allocated_bytes / GiB,
        "memory/peak_reserved_gib": peak_reserved_bytes / GiB,
        "memory/predicted_peak_gib": predicted_peak_bytes / GiB,
        "memory/peak_over_predicted": peak_allocated_bytes / max(predicted_peak_bytes, 1),
    }


def depth_label(depth: float) -> str:
    """A needle depth as a name part: percent, `.` spelled `p` (0.25 -> 25, 0.125 -> 12p5)."""
    return f"{depth * 100:g}".replace(".", "p")


def eval_series(result: EvalResult) -> dict[str, float]:
    """An evaluation's series: the loss overall and per context-length bucket (buckets that
    scored no token are left out), and the passkey grid."""
    series = {"eval/loss": result.loss, "eval/perplexity": result.perplexity}
    for bucket in result.buckets:
        if bucket.tokens:
            series[f"eval_loss_by_length/len_{bucket.start}_{bucket.stop}"] = bucket.loss
    if result.passkey:
        for cell in result.passkey:
            name = f"eval_passkey/len_{cell.length}_depth_{depth_label(cell.depth)}"
            series[name] = cell.retrieved / cell.trials
        retrieved = sum(cell.retrieved for cell in result.passkey)
        series["eval/passkey_accuracy"] = retrieved / sum(cell.trials for cell in result.passkey)
    return series


def run_config(spec: JobSpec) -> dict[str, Any]:
    """The run's configuration: the resolved spec, and the batch figures derived from it. The
    values of fabric.env are left out: they may hold credentials, and a tracker may send its
    configuration to a server."""
    config = spec.model_dump(mode="json")
    config["fabric"]["env"] = {name: REDACTED for name in config["fabric"]["env"]}
    config["derived"] = {
        "world_size": spec.cluster.world_size,
        "dp": spec.parallel_dims.dp,
        "grad_accum": spec.grad_accum,
        "global_batch": spec.global_batch,
        "tokens_per_step": spec.tokens_per_step,
    }
    return config


def flat_params(config: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, str]]:
    """(dotted path, value as text) of every leaf of `config`, as MLflow parameters: a list, a
    null or an empty mapping as JSON."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flat_params(value, f"{prefix}{key}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            yield f"{prefix}{key}", text[:MLFLOW_PARAM_CHARS]


# -- the trackers ----------------------------------------------------------------------------


class TrackerStartError(Exception):
    """A tracker cannot start, for the reason given (the message is the whole story)."""


class TrackerWriteError(Exception):
    """A tracker that writes from a thread of its own failed to write `step`."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason = step, reason


class Writer(Protocol):
    """One started tracker."""

    kind: str

    def log(self, series: Mapping[str, float], step: int) -> None:
        """Write `series` at `step`; raises on a failure."""

    def close(self, exit_code: int | None) -> None:
        """Flush and finish (the run ended with `exit_code`; None: not known)."""


class TensorBoardWriter:
    """Event files through torch.utils.tensorboard.SummaryWriter (which writes from its own
    thread)."""

    kind = "tensorboard"

    def __init__(self, log_dir: Path, config: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            probe = log_dir / ".ctxlaunch-write-test"
            probe.write_bytes(b"")  # SummaryWriter's own thread would fail silently later
            probe.unlink()
        except OSError as exc:
            raise TrackerStartError(f"log_dir {log_dir} is not writable ({exc})") from None
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))
        # Markdown: TensorBoard's text tab renders a fenced block as code.
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, series: Mapping[str, float], step: int) -> None:
        for name, value in series.items():
            self.writer.add_scalar(name, value, step)

    def close(self, exit_code: int | None) -> None:
        self.writer.close()


def _check_reachable(uri: str) -> None:
    """Raise TrackerStartError if an http(s) tracking server does not accept a connection:
    MLflow's client would otherwise retry for minutes before saying so."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=CONNECT_TIMEOUT_SECONDS).close()
    except OSError as exc:
        raise TrackerStartError(
            f"tracking server {parsed.hostname}:{port} unreachable ({exc.strerror or exc})"
        ) from None


class MlflowWriter:
    """An MLflow run through MlflowClient. The run and its parameters are made at the start;
    the steps' metrics go out from a thread of their own, so a slow or vanished tracking
    server never holds up a step."""

    kind = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, config: Mapping[str, Any]):
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store behind an opt-in; this is the store the spec chose.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _check_reachable(uri)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id if found is not None else self.client.create_experiment(experiment)
        )
        run = self.client.create_run(
            experiment_id, run_name=run_name, tags={"ctxlaunch.job": str(config["name"])}
        )
        self.run_id = run.info.run_id
        params = [Param(key, value) for key, value in flat_params(config)]
        for first in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(
                self.run_id, params=params[first : first + MLFLOW_PARAMS_PER_BATCH]
            )
        self.error: TrackerWriteError | None = None
        self._queue: queue.Queue[tuple[int, int, dict[str, float]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._send, name="ctxlaunch-mlflow", daemon=True)
        self._thread.start()

    def _send(self) -> None:
        from mlflow.entities import Metric

        while (item := self._queue.get()) is not None:
            if self.error is not None:
                continue  # failed: drain until closed
            step, millis, series = item
            try:
                metrics = [Metric(name, value, millis, step) for name, value in series.items()]
                self.client.log_batch(self.run_id, metrics=metrics)
            except Exception as exc:  # noqa: BLE001 - reported by the next log() or close()
                self.error = TrackerWriteError(step, _describe(exc))

    def log(self, series: Mapping[str, float], step: int) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put((step, int(time.time() * 1000), dict(series)))

    def close(self, exit_code: int | None) -> None:
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_SECONDS)
        if self._thread.is_alive():
            raise RuntimeError(
                f"metrics still unsent after {CLOSE_TIMEOUT_SECONDS:g} s; the last steps may "
                "be missing"
            )
        if self.error is not None:
            raise self.error
        status = (
            "FINISHED"
            if exit_code in (exitcodes.OK, None)
            else "KILLED"  # stopped by a signal, to be requeued
            if exit_code == exitcodes.PREEMPTED
            else "FAILED"
        )
        self.client.set_terminated(self.run_id, status)


class WandbWriter:
    """A W&B run through wandb.init (whose own service process writes it). The console is not
    captured: the job's log already has it, and the trainer's streams stay its own."""

    kind = "wandb"

    def __init__(
        self,
        *,
        project: str,
        entity: str | None,
        mode: Literal["offline", "online"],
        directory: Path,
        run_name: str,
        config: Mapping[str, Any],
    ):
        import wandb

        try:
            # W&B falls back to a temporary directory when `dir` is not writable; make it here,
            # so that a bad directory is reported rather than written around.
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".ctxlaunch-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise TrackerStartError(f"dir {directory} is not writable ({exc})") from None
        self.run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            dir=str(directory),
            name=run_name,
            config=dict(config),
            settings=wandb.Settings(console="off"),
        )

    def log(self, series: Mapping[str, float], step: int) -> None:
        self.run.log(dict(series), step=step)

    def close(self, exit_code: int | None) -> None:
        self.run.finish(exit_code=exit_code)


def _say_on_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def open_writer(
    tracker: TrackerSpec, spec: JobSpec, run_dir: Path, run_name: str, config: Mapping[str, Any]
) -> Writer:
    """Start one tracker, its settings' defaults resolved against the run directory and the
    job; raises ImportError without its library, TrackerStartError or the library's error."""
    if isinstance(tracker, TensorBoardTrackerSpec):
        return TensorBoardWriter(Path(tracker.log_dir or run_dir / "tensorboard"), config)
    if isinstance(tracker, MlflowTrackerSpec):
        uri = tracker.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        experiment = tracker.experiment or spec.name
        return MlflowWriter(uri, experiment, tracker.run_name or run_name, config)
    assert isinstance(tracker, WandbTrackerSpec)
    return WandbWriter(
        project=tracker.project or spec.name,
        entity=tracker.entity,
        mode=tracker.mode,
        directory=Path(tracker.dir or run_dir),
        run_name=run_name,
        config=config,
    )


class Trackers:
    """The trackers of one run (none on ranks other than 0): `log` the series of a step or an
    evaluation, `close` at the end. A tracker that fails is reported once and dropped."""

    def __init__(
        self,
        writers: list[Writer],
        *,
        log_interval: int = 1,
        last_step: int = 0,
        say: Callable[[str], None] | None = None,
    ):
        self.writers, self.log_interval, self.last_step = writers, log_interval, last_step
        self._say = say or _say_on_stderr

    @classmethod
    def start(
        cls,
        spec: JobSpec,
        run_dir: Path,
        *,
        run_name: str,
        say: Callable[[str], None] | None = None,
    ) -> Trackers:
        """Start every tracker of spec.telemetry.trackers (call on rank 0 only); `say` reports
        a tracker that cannot start or fails (default: a line on stderr)."""
        say = say or _say_on_stderr
        writers: list[Writer] = []
        config = run_config(spec) if spec.telemetry.trackers else {}
        for tracker in spec.telemetry.trackers:
            kind = tracker.kind
            try:
                writers.append(open_writer(tracker, spec, run_dir, run_name, config))
            except ImportError as exc:
                say(
                    f"ctxlaunch telemetry: tracker {kind} not started: its library is not "
                    f"installed ({exc}); pip install 'ctxlaunch[{kind}]'. Training goes on "
                    "without it"
                )
            except Exception as exc:  # noqa: BLE001 - whatever the library raises
                reason = str(exc) if isinstance(exc, TrackerStartError) else _describe(exc)
                say(
                    f"ctxlaunch telemetry: tracker {kind} not started: {reason}. Training "
                    "goes on without it"
                )
        training = spec.training
        return cls(writers, log_interval=training.log_interval, last_step=training.steps, say=say)

    @property
    def active(self) -> bool:
        return bool(self.writers)

    def logs_step(self, step: int) -> bool:
        """Whether `step` is a logged step (as the console and metrics.jsonl log it)."""
        return bool(self.writers) and (step % self.log_interval == 0 or step == self.last_step)

    def log(self, series: Mapping[str, float], step: int) -> None:
        """Write `series` at `step` to every tracker still running."""
        for writer in list(self.writers):
            try:
                writer.log(series, step)
            except TrackerWriteError as exc:  # an earlier step, written from a thread
                self._drop(writer, f"failed at step {exc.step}: {exc.reason}")
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                self._drop(writer, f"failed at step {step}: {_describe(exc)}")

    def close(self, exit_code: int | None = None) -> None:
        """Flush and finish every tracker (the run ended with `exit_code`)."""
        writers, self.writers = self.writers, []
        for writer in writers:
            try:
                writer.close(exit_code)
            except TrackerWriteError as exc:
                self._say(
                    f"ctxlaunch telemetry: tracker {writer.kind} failed at step {exc.step}: "
                    f"{exc.reason}"
                )
            except Exception as exc:  # noqa: BLE001
                self._say(
                    f"ctxlaunch telemetry: tracker {writer.kind} failed to close: {_describe(exc)}"
                )

    def _drop(self, writer: Writer, what: str) -> None:
        self.writers.remove(writer)
        self._say(f"ctxlaunch telemetry: tracker {writer.kind} {what}; disabled, training goes on")
        try:
            writer.close(None)
        except Exception:  # noqa: BLE001, S110 - already reported as failed
            pass


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0].rstrip('.')}" if text else type(exc).__name__
