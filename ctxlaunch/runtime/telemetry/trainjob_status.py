"""A TrainJob's progress where `kubectl get trainjob` shows it: rank 0 writes
status.trainerStatus (progressPercentage, estimatedRemainingSeconds, the step's metrics,
lastUpdatedTime; Kubeflow Trainer v2.3.0, KEP-2779) through the API server's status
subresource, as the job's own service account, whose Role allows nothing else.

Writing never stops or slows training: the latest state is written from a background thread at
most every `interval_seconds` (and once more at the end), each request with a short timeout; a
refusal or an unreachable server is said once and retried at the next write."""

from __future__ import annotations

import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxlaunch.contract.rundir import TRAINJOB_ENV, TRAINJOB_TOKEN_DIR

if TYPE_CHECKING:
    from ctxlaunch.runtime.records import StepMetrics

TRAINJOBS = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"
REQUEST_TIMEOUT_SECONDS = 5.0
INTERVAL_SECONDS = 15.0
METRIC_VALUE_CHARS = 64
"""The CRD's maxLength of a metric's value (and name)."""


@dataclass(frozen=True)
class ApiAccess:
    """How to reach the API server: its URL, the bearer token (read from `token_file` at each
    request, since a projected token is rotated), the CA to trust, any further headers."""

    server: str
    token_file: Path | None = None
    token: str | None = None
    ca_file: Path | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def in_pod(cls, token_dir: str = TRAINJOB_TOKEN_DIR) -> ApiAccess | None:
        """The access a TrainJob's trainer container is given (the in-cluster service address
        and the projected token), or None outside such a container."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        directory = Path(token_dir)
        if not host or not (directory / "token").is_file():
            return None
        if ":" in host:  # an IPv6 service address
            host = f"[{host}]"
        ca = directory / "ca.crt"
        return cls(
            f"https://{host}:{port}", directory / "token", None, ca if ca.is_file() else None
        )

    def bearer(self) -> str:
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return self.token or ""


def _value(value: float | int | str) -> str:
    """A metric value as the CRD takes it: a string of at most 64 characters."""
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text[:METRIC_VALUE_CHARS]


def trainer_status(
    metrics: StepMetrics, now: float | None = None, *, done: bool = False
) -> dict[str, Any]:
    """status.trainerStatus for the last step: progress in whole per cent (100 only when the
    run is done), the seconds left, the step's loss, MFU, tokens/s and step time beside the
    predicted step, and when it was observed (RFC 3339, UTC)."""
    percent = 100 if done else min(int(metrics.progress * 100), 99)
    status: dict[str, Any] = {
        "progressPercentage": percent,
        "metrics": [
            {"name": name, "value": _value(value)}
            for name, value in (
                ("step", metrics.step),
                ("steps", metrics.steps),
                ("loss", metrics.loss),
                ("step_seconds", metrics.step_seconds),
                ("predicted_step_seconds", metrics.predicted_step_seconds or 0.0),
                ("tokens_per_second_per_gpu", metrics.tokens_per_second_per_gpu),
                ("model_tflops_per_gpu_causal", metrics.model_tflops_per_gpu_causal),
            )
        ],
        "lastUpdatedTime": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now)
        ),
    }
    if done:
        status["estimatedRemainingSeconds"] = 0
    elif metrics.remaining_seconds is not None:
        status["estimatedRemainingSeconds"] = min(int(metrics.remaining_seconds), 2**31 - 1)
    return status


class TrainJobProgress:
    """Rank 0's writer of its TrainJob's trainerStatus: `on_step(metrics)` each step (a trainer
    observer), `close(exit_code)` at the end."""

    def __init__(
        self,
        access: ApiAccess,
        namespace: str,
        name: str,
        *,
        interval_seconds: float = INTERVAL_SECONDS,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.access = access
        self.path = TRAINJOBS.format(namespace=namespace, name=name)
        self.interval = interval_seconds
        self._log = log or (lambda text: None)
        self._warned = False
        self._latest: StepMetrics | None = None
        self._written: StepMetrics | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ctxlaunch-trainjob", daemon=True)
        self._thread.start()

    def on_step(self, metrics: StepMetrics) -> None:
        """The latest step: written now if none was yet, else at the next interval."""
        with self._lock:
            first = self._latest is None
            self._latest = metrics
        if first:
            self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if not self._stop.is_set():
                self._write_latest(done=False)

    def _write_latest(self, *, done: bool) -> None:
        with self._lock:
            metrics = self._latest
        if metrics is None or (metrics is self._written and not done):
            return
        if self.write(trainer_status(metrics, done=done)):
            self._written = metrics

    def write(self, status: dict[str, Any]) -> bool:
        """Merge-patch the TrainJob's status with `status` as its trainerStatus; whether the
        API server took it (a refusal is said once, never raised)."""
        body = json.dumps({"status": {"trainerStatus": status}}).encode()
        request = urllib.request.Request(
            self.access.server + self.path,
            data=body,
            method="PATCH",
            headers={
                "Content-Type": "application/merge-patch+json",
                "Authorization": f"Bearer {self.access.bearer()}",
                "Accept": "application/json",
                **self.access.headers,
            },
        )
        context = ssl.create_default_context(
            cafile=str(self.access.ca_file) if self.access.ca_file else None
        )
        try:
            with urllib.request.urlopen(
                request, timeout=REQUEST_TIMEOUT_SECONDS, context=context
            ) as answer:
                answer.read()
        except (OSError, urllib.error.URLError, ValueError) as exc:
            if not self._warned:
                self._warned = True
                reason = (
                    exc.read().decode(errors="replace")[:300]
                    if isinstance(exc, urllib.error.HTTPError)
                    else str(exc)
                )
                self._log(
                    f"ctxlaunch: cannot write the TrainJob's trainerStatus ({reason}); "
                    "training goes on, retrying at the next write"
                )
            return False
        return True

    def close(self, exit_code: int | None = None) -> None:
        """Stop the thread and write the last state (100 % when the run completed)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_SECONDS + 1)
        self._write_latest(done=exit_code == 0)


def trainjob_progress(rank: int, log: Callable[[str], None]) -> TrainJobProgress | None:
    """Rank 0's TrainJob progress writer where the pod is given one (CTXLAUNCH_TRAINJOB and the
    projected token: cluster.kubernetes.trainer_status), else None."""
    target = os.environ.get(TRAINJOB_ENV, "")
    if rank != 0 or "/" not in target:
        return None
    access = ApiAccess.in_pod()
    if access is None:
        log(
            f"ctxlaunch: {TRAINJOB_ENV} is set but no token is mounted at {TRAINJOB_TOKEN_DIR}: "
            "the TrainJob's trainerStatus is not written"
        )
        return None
    namespace, name = target.split("/", 1)
    return TrainJobProgress(access, namespace, name, log=log)
