"""The `/metrics` endpoint of one rank: Prometheus' text exposition of the rank's registry, on
the address the spec gives, answering `/metrics` only.

prometheus_client's own server listens on every interface and answers every path with the
metrics; this one binds where it is told (127.0.0.1 by default for a job on this machine, so
no other host reads a local job's metrics) and says 404 to anything but `/metrics`. It exposes
the job's identity labels (job, run, rank, node), its training figures (loss, throughput, MFU,
memory, restarts) and nothing else: no environment, no spec, no paths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

METRICS_PATH = "/metrics"


class _QuietHandler(WSGIRequestHandler):
    """No access log on the rank's stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def metrics_app(registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
    """A WSGI app serving `registry` at /metrics (GET and HEAD) and 404 everywhere else."""
    exposition = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"ctxlaunch serves /metrics only\n"]
        return exposition(environ, start_response)

    return app


def serve_metrics(registry: CollectorRegistry, address: str, port: int) -> WSGIServer:
    """Serve `registry` on address:port from a daemon thread; OSError if the port is taken or
    the address is not this machine's."""
    import socket

    server_class: type[WSGIServer] = _ThreadingServer
    if ":" in address:  # an IPv6 address

        class _Server6(_ThreadingServer):
            address_family = socket.AF_INET6

        server_class = _Server6
    server = make_server(
        address, port, metrics_app(registry), server_class, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="ctxlaunch-metrics", daemon=True).start()
    return server
