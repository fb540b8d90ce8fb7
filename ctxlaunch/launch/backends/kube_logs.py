"""A Kubernetes job's logs: a pod's trainer log read whole or followed as it is written, and one
rank's lines picked out of it.

A followed log is read by a thread into a queue (LogStream), so that the reader can look at the
job's state while the log is quiet: the kubelet does not always close a follow stream when the
container ends, and `logs --follow` must still return once the job is over.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ctxlaunch.launch.backends.kube_connection import ApiError, Connection, KubeError
from ctxlaunch.launch.backends.kube_jobs import CONTAINER, TRAINER_CONTAINERS

FOLLOW_POLL_S = 2.0
"""Seconds between looks at the job's state while a followed log is quiet."""
FOLLOW_DRAIN_S = 3.0
"""Once the job is over, how long a still-open log may stay quiet before following ends: nothing
guarantees that the follow stream closes when the container ends (one can stay open for minutes
after the job's end)."""


class LogStream:
    """One pod's log as it arrives: a thread reads the lines into a queue, so that the reader
    can look at the job between them; `abort` ends the read (shuts the connection)."""

    def __init__(self, lines: Iterable[bytes], abort: Callable[[], None]):
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue()
        self._abort = abort
        self._aborted = False
        self._thread = threading.Thread(
            target=self._read, args=(lines,), daemon=True, name="ctxlaunch-log"
        )
        self._thread.start()

    def _read(self, lines: Iterable[bytes]) -> None:
        try:
            for line in lines:
                self._queue.put(line)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which decides
            self._queue.put(exc)
        self._queue.put(None)

    def get(self, timeout: float) -> bytes | None:
        """The next line; None at the stream's end; TimeoutError when none came in time."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if isinstance(item, BaseException):
            if self._aborted:
                return None
            raise KubeError(f"the log stream broke off: {item}") from item
        return item

    def close(self) -> None:
        """End the read: the reading thread's connection is shut, and `get` then ends."""
        self._aborted = True
        self._abort()


def follow_lines(
    stream: LogStream,
    state: Callable[[], str],
    poll: float | None = None,
    drain: float | None = None,
) -> Iterator[bytes]:
    """A followed log's lines until it ends, or until `state()` (asked whenever the log was
    quiet for `poll` seconds) says "replaced" (the pod is gone), or says "over" (the job
    reached a final state) and the log then stays quiet for `drain` seconds: a follow stream
    that no one closes cannot hold `logs --follow` past the job's end."""
    poll = FOLLOW_POLL_S if poll is None else poll
    drain = FOLLOW_DRAIN_S if drain is None else drain
    over = False
    try:
        while True:
            try:
                line = stream.get(drain if over else poll)
            except TimeoutError:
                if over:
                    return
                now = state()
                if now == "replaced":
                    return
                over = now == "over"
                continue
            if line is None:
                return
            yield line
    finally:
        stream.close()


def abort_response(response: Any) -> None:
    """End a streamed urllib3 response from another thread: shut its socket (a blocked read
    then returns), then release it."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        response.close()


def open_log_stream(conn: Connection, pod: dict[str, Any]) -> LogStream | None:
    """The pod's trainer log as a stream (follow=true), or None while its container is
    still waiting to start (the kubelet answers 400 until then)."""
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/log"
    try:
        _, response = conn.request(
            "GET",
            path,
            query=[("container", trainer_container(pod)), ("follow", "true")],
            raw=True,
            timeout=None,
        )
    except ApiError as exc:
        if exc.status in (400, 404):  # waiting to start, or deleted in between
            return None
        raise
    return LogStream(response, lambda: abort_response(response))


def trainer_container(pod: dict[str, Any]) -> str:
    """The name of the pod's trainer container (pytorch, or a TrainJob's node)."""
    names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
    return next((n for n in names if n in TRAINER_CONTAINERS), CONTAINER)


def pod_log(conn: Connection, pod: dict[str, Any], tail: int | None = None) -> str:
    """The pod's trainer log as it stands (its last `tail` lines only, when given)."""
    meta = pod["metadata"]
    query = [("container", trainer_container(pod))]
    if tail:
        query.append(("tailLines", str(tail)))
    try:
        _, response = conn.request(
            "GET",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/log",
            query=query,
            raw=True,
        )
    except ApiError as exc:
        raise KubeError(f"the log of pod {meta['name']} cannot be read: {exc}") from None
    return response.read().decode(errors="replace")


def rank_lines(lines: list[str], rank: int) -> list[str]:
    """torchrun --role=rank --tee=3 prefixes rank r's lines with "[rank<r>]:"; keep one rank's,
    unprefixed."""
    prefix = f"[rank{rank}]:"
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]
