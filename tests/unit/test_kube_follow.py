"""`logs --follow` on Kubernetes ends with the job: the follow loop (follow_lines, LogStream)
over a real HTTP log stream from a local server that plays a kubelet which never closes a
follow stream (on the real single-node cluster a follow that waited on the stream alone did
not return for minutes after the job's end). No API server is needed: the job's state is the
function follow_lines asks between reads. tests/service/kubernetes_api/test_kubernetes.py runs
the same loop through `ctxlaunch logs --follow` against the real API server's job and pod
objects."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import urllib3

from ctxlaunch.launch.backends.kube_logs import LogStream, abort_response, follow_lines


def client_left(conn: socket.socket) -> bool:
    """Whether the client shut its end (its socket reads as ended)."""
    readable, _, _ = select.select([conn], [], [], 0)
    return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""


class Kubelet:
    """An HTTP server that streams the lines put in `lines` as chunks, and ends the response
    only when `end` is set (never, unless a test sets it)."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.end = threading.Event()
        self.sent = threading.Condition()
        self.closed = threading.Event()  # the client went away
        kubelet = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                written = 0
                try:
                    while True:
                        with kubelet.sent:
                            kubelet.sent.wait_for(
                                lambda: len(kubelet.lines) > written or kubelet.end.is_set(),
                                timeout=0.2,
                            )
                            pending = kubelet.lines[written:]
                        for line in pending:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                            self.wfile.flush()
                        written += len(pending)
                        if kubelet.end.is_set() and written == len(kubelet.lines):
                            self.wfile.write(b"0\r\n\r\n")
                            self.wfile.flush()
                            return
                        if not pending and client_left(self.connection):
                            kubelet.closed.set()
                            return
                except OSError:
                    kubelet.closed.set()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def write(self, line: bytes) -> None:
        with self.sent:
            self.lines.append(line)
            self.sent.notify_all()

    def stream(self) -> LogStream:
        """A follow stream of this log, as Connection.request(raw=True) returns it: the
        unread urllib3 response, ended by abort_response."""
        pool = urllib3.PoolManager(retries=False)
        response = pool.request(
            "GET", f"http://127.0.0.1:{self.server.server_port}/log", preload_content=False
        )
        return LogStream(response, lambda: abort_response(response))

    def stop(self) -> None:
        self.end.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kubelet() -> Iterator[Kubelet]:
    server = Kubelet()
    yield server
    server.stop()


class Job:
    """The job's state as follow_lines asks for it, and how often it asked."""

    def __init__(self) -> None:
        self.state = "running"
        self.asked = 0

    def __call__(self) -> str:
        self.asked += 1
        return self.state


@pytest.mark.timeout(60)
def test_follow_ends_after_the_job_although_the_stream_stays_open(kubelet: Kubelet) -> None:
    """The stream is never closed: following ends `drain` seconds after the job is over, with
    every line, the ones written just before the end included."""
    job = Job()
    kubelet.write(b"[rank0]:step 1/2\n")
    got: list[bytes] = []
    lines = follow_lines(kubelet.stream(), job, poll=0.2, drain=1.0)
    got.append(next(lines))
    assert got == [b"[rank0]:step 1/2\n"]
    threading.Timer(0.6, kubelet.write, (b"[rank0]:step 2/2\n",)).start()
    got.append(next(lines))  # quiet for 0.6 s: the job is asked, and still runs
    assert job.asked >= 1
    job.state = "over"
    kubelet.write(b"[rank0]:done\n")  # after the job's end: drained, not lost
    started = time.monotonic()
    got += list(lines)
    took = time.monotonic() - started
    assert got == [b"[rank0]:step 1/2\n", b"[rank0]:step 2/2\n", b"[rank0]:done\n"]
    assert took < 5.0, took
    # The connection was shut: the server sees its client gone.
    assert kubelet.closed.wait(5.0)


@pytest.mark.timeout(60)
def test_follow_keeps_going_while_the_job_runs(kubelet: Kubelet) -> None:
    """A quiet log is not an end: while the job runs, following waits (asking each poll)."""
    job = Job()
    lines = follow_lines(kubelet.stream(), job, poll=0.1, drain=0.5)
    result: list[bytes] = []
    reader = threading.Thread(target=lambda: result.extend(lines), daemon=True)
    reader.start()
    time.sleep(1.5)
    assert reader.is_alive() and job.asked >= 5
    kubelet.write(b"late\n")
    kubelet.end.set()  # the kubelet closes the stream: following ends at once
    reader.join(5.0)
    assert not reader.is_alive() and result == [b"late\n"]


@pytest.mark.timeout(60)
def test_follow_ends_when_the_pod_is_replaced(kubelet: Kubelet) -> None:
    """The operator deleted the pod (to recreate it under the same name): this stream ends
    at the next look even though no one closes it, so the caller can follow the new pod."""
    job = Job()
    kubelet.write(b"before the restart\n")
    lines = follow_lines(kubelet.stream(), job, poll=0.2, drain=5.0)
    assert next(lines) == b"before the restart\n"
    job.state = "replaced"
    started = time.monotonic()
    assert list(lines) == []
    assert time.monotonic() - started < 2.0
