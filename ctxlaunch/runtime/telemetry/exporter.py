"""Per-rank Prometheus export: served for scraping, or pushed to a Pushgateway.

Export never stops or slows training: pushes happen on a background thread with a short
timeout, an unreachable Pushgateway or a busy scrape port is logged once and retried, and the
step only sets gauges (a few dictionary writes).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import push_to_gateway

from ctxlaunch.contract.parallel_dims import ParallelDims
from ctxlaunch.runtime.telemetry.metrics import LABELS, METRICS, Metric

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from ctxlaunch.contract.spec import JobSpec

PUSH_TIMEOUT_SECONDS = 3.0


@dataclass(frozen=True)
class Identity:
    """Who a rank is, for the labels every series carries."""

    job: str
    run: str
    rank: int
    local_rank: int
    node: str
    model: str
    dims: ParallelDims
    """The job's degrees: the CP degree and algorithm label every series."""
    seq_len: int

    def labels(self) -> dict[str, str]:
        return {
            "job": self.job,
            "run": self.run,
            "rank": str(self.rank),
            "node": self.node,
            "model": self.model,
            "cp": str(self.dims.cp),
            "cp_algorithm": self.dims.cp_algorithm,
            "seq_len": str(self.seq_len),
        }


def identity_from_spec(
    spec: JobSpec, rank: int, local_rank: int, run: str | None = None
) -> Identity:
    """The labels of this rank's series, from the spec and the launcher's environment."""
    return Identity(
        job=spec.name,
        run=run
        or os.environ.get("CTXLAUNCH_RUN_ID")
        or os.environ.get("CTXLAUNCH_JOB_ID")
        or os.environ.get("SLURM_JOB_ID")
        or "manual",
        rank=rank,
        local_rank=local_rank,
        node=socket.gethostname(),
        model=spec.model.preset or "custom",
        dims=spec.parallel_dims,
        seq_len=spec.training.seq_len,
    )


class Exporter:
    """The registry of one rank and its way out (scrape, push or nothing)."""

    def __init__(
        self,
        identity: Identity,
        *,
        mode: str,
        port: int = 9400,
        bind_address: str = "127.0.0.1",
        pushgateway_url: str | None = None,
        push_interval_seconds: float = 15.0,
        log: Callable[[str], None] | None = None,
    ):
        self.identity = identity
        self.mode = mode
        self.registry = CollectorRegistry()
        self._labels = identity.labels()
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._warned: set[str] = set()
        self._series: dict[str, Gauge | Counter] = {}
        for metric in METRICS:
            self._series[metric.name] = self._make(metric)
            if metric.kind == "counter" and not metric.extra_labels:
                # Exist at 0 from the start: increase() and the dashboards need a baseline.
                self.series(metric.name)
            if metric.kind == "counter":
                # A labelled counter at 0 for each label it is known to take (why: oom or
                # allocation): a panel of it reads 0 from the first scrape, not "no data".
                for known in metric.known_labels:
                    self.series(metric.name, **dict(known))
        self.url = pushgateway_url
        self.interval = push_interval_seconds
        self._stop = threading.Event()
        self._push_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self._server: WSGIServer | None = None
        if mode == "scrape":
            self._serve(bind_address, port + identity.local_rank)
        elif mode == "push":
            if not pushgateway_url:
                raise ValueError("push mode needs a Pushgateway URL")
            self._thread = threading.Thread(
                target=self._push_loop, name="ctxlaunch-push", daemon=True
            )
            self._thread.start()

    def _make(self, metric: Metric) -> Gauge | Counter:
        labelnames = list(LABELS) + list(metric.extra_labels)
        if metric.kind == "counter":
            # prometheus_client appends _total itself.
            return Counter(
                metric.name.removesuffix("_total"), metric.help, labelnames, registry=self.registry
            )
        return Gauge(metric.name, metric.help, labelnames, registry=self.registry)

    def series(self, name: str, **extra: str) -> Gauge | Counter:
        return self._series[name].labels(**self._labels, **extra)

    def set(self, name: str, value: float, **extra: str) -> None:
        series = self.series(name, **extra)
        if isinstance(series, Counter):
            raise TypeError(f"{name} is a counter: inc() it, never set() it")
        series.set(value)

    def inc(self, name: str, amount: float = 1.0, **extra: str) -> None:
        self.series(name, **extra).inc(amount)

    # -- ways out ----------------------------------------------------------------------------
    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._log(text)

    def _serve(self, address: str, port: int) -> None:
        from ctxlaunch.runtime.telemetry.metrics_server import serve_metrics

        try:
            self._server = serve_metrics(self.registry, address, port)
            self.port = port
        except OSError as exc:
            self._warn_once(
                "serve",
                f"ctxlaunch telemetry: cannot serve /metrics on {address} port "
                f"{port} ({exc.strerror or exc}); training continues without it",
            )

    def push(self) -> bool:
        """Push now (from any thread); False if the Pushgateway could not be reached."""
        if self.mode != "push" or not self.url:
            return False
        grouping = {"run": self.identity.run, "rank": str(self.identity.rank)}
        with self._push_lock:
            try:
                push_to_gateway(
                    self.url,
                    job=self.identity.job,
                    registry=self.registry,
                    grouping_key=grouping,
                    timeout=PUSH_TIMEOUT_SECONDS,
                )
            except Exception as exc:  # noqa: BLE001 - any failure: log once, retry later
                self._warn_once(
                    "push",
                    f"ctxlaunch telemetry: cannot push to {self.url} "
                    f"({exc}); retrying every {self.interval:g} s, training "
                    "continues",
                )
                return False
        if "push" in self._warned:
            self._warned.discard("push")
            self._log(f"ctxlaunch telemetry: pushing to {self.url} again")
        return True

    def _push_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.push()

    def close(self) -> None:
        """Stop the push thread and push once more (batch jobs end; the last values matter)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PUSH_TIMEOUT_SECONDS + 1)
        if self.mode == "push":
            self.push()
        if self._server is not None:  # the port is free again for the next run in this process
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def scrape_text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
