# Shapes: any contiguous tensor travels as is; a ring step moves (B, Hkv, S_local, D) K/V blocks.
"""Ring point-to-point transfers: post sends to the next rank and receives from the previous one,
compute while they fly, then wait (``send_recv`` / ``commit`` / ``wait``)."""

from __future__ import annotations

import collections
import contextlib
import datetime
import time

import torch
import torch.distributed as dist

# Seconds every ring transfer takes at least, counted from its commit (0: off). A benchmark
# sets it through ``simulated_link_delay`` to emulate a slow link and make overlap visible.
_link_delay_s = 0.0
# How long a ring transfer, or any collective on a group `new_group` makes, may take. A wait given
# no deadline takes its group's, and a subgroup made without one has torch's default (30 minutes
# on gloo): a stopped peer would hold its neighbours that long. timedelta(0) = torch's defaults.
_wait_timeout = datetime.timedelta(0)


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream ring transfers run on: one side stream per CUDA device, None elsewhere (gloo on
    the CPU overlaps through its own threads)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


_side_streams: dict[int, torch.cuda.Stream] = {}


def set_wait_timeout(seconds: float) -> None:
    """Make every ring wait, and every group `new_group` makes from now on, fail after
    `seconds` (the trainer passes its collective timeout)."""
    global _wait_timeout
    _wait_timeout = datetime.timedelta(seconds=seconds)


def new_group(ranks: list[int], **kwargs) -> dist.ProcessGroup:
    """``dist.new_group`` under the timeout given to `set_wait_timeout`. A subgroup does not
    inherit the one ``init_process_group`` was given: it takes torch's default (30 minutes on
    gloo, 10 on NCCL), so a stopped peer held its CP, TP or DP group's collectives that long
    while the job's timeout was seconds (found by the Slurm hung-rank test)."""
    if _wait_timeout:
        kwargs.setdefault("timeout", _wait_timeout)
    return dist.new_group(ranks, **kwargs)


# Seconds this process has spent blocked on CP communication (ring waits, Ulysses all-to-alls):
# the communication that compute did not hide. Telemetry reads the difference per step.
_exposed_s = 0.0


def exposed_comm_seconds() -> float:
    """Cumulative seconds this process spent waiting on context-parallel communication after
    its own compute was done (ring ``wait``, Ulysses all-to-all)."""
    return _exposed_s


# How many ring commits moved how many bytes each (sends only; a hop receives as much), since
# the process started: what the per-hop transfer test reads.
_commit_bytes: collections.Counter[int] = collections.Counter()


def commit_sizes() -> dict[int, int]:
    """Bytes sent per ring commit -> how many commits sent that many, so far in this process."""
    return dict(_commit_bytes)


# How many point-to-point sends of a halo exchange (one peer's K/V rows, or their gradients)
# moved how many bytes each, since the process started: what the window tests read.
_exchange_bytes: collections.Counter[int] = collections.Counter()


def exchange_sizes() -> dict[int, int]:
    """Bytes per halo send -> how many sends moved that many, so far in this process."""
    return dict(_exchange_bytes)


@contextlib.contextmanager
def exposed():
    """Count the time spent inside this block as exposed communication."""
    global _exposed_s
    start = time.perf_counter()
    try:
        yield
    finally:
        _exposed_s += time.perf_counter() - start


@contextlib.contextmanager
def simulated_link_delay(seconds: float):
    """Within this block, each ring ``wait`` returns no sooner than ``seconds`` after its commit."""
    global _link_delay_s
    previous, _link_delay_s = _link_delay_s, float(seconds)
    try:
        yield
    finally:
        _link_delay_s = previous


class RingComm:
    """Non-blocking transfers around the ring of ``group``: rank i sends to i+1, receives from i-1.

    With a CUDA ``stream`` the transfers are issued on it: at ``commit`` it first waits for the
    compute stream (the data to send is ready), the buffers are marked as used on it
    (``record_stream``), and ``wait`` makes the compute stream wait for it, so the next block's
    compute is ordered after its data arrived while the current one runs beside the transfer.
    """

    def __init__(self, group: dist.ProcessGroup | None, stream: torch.cuda.Stream | None = None):
        if group is None:
            group = dist.group.WORLD
            assert group is not None, "torch.distributed is not initialised"
        self.group: dist.ProcessGroup = group
        rank = dist.get_rank(self.group)
        world_size = dist.get_world_size(self.group)
        # P2P ops address global ranks even when they run on a subgroup.
        self.send_to = dist.get_global_rank(self.group, (rank + 1) % world_size)
        self.recv_from = dist.get_global_rank(self.group, (rank - 1) % world_size)
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []
        self._committed_at = 0.0
        self._stream = stream

    def send_recv(
        self, to_send: torch.Tensor, recv_buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Queue sending ``to_send`` (contiguous) and receiving a tensor like it; return the receive
        buffer, which holds the data only after :meth:`wait`."""
        if recv_buffer is None:
            recv_buffer = torch.empty_like(to_send)
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_to, self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv_buffer, self.recv_from, self.group))
        return recv_buffer

    def commit(self) -> None:
        """Start every queued transfer."""
        _commit_bytes[sum(op.tensor.nbytes for op in self._ops if op.op is dist.isend)] += 1
        if self._stream is None:
            self._reqs = dist.batch_isend_irecv(self._ops)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._reqs = dist.batch_isend_irecv(self._ops)
            for op in self._ops:
                op.tensor.record_stream(self._stream)
        self._ops = []
        self._committed_at = time.perf_counter()

    def wait(self) -> None:
        """Block until the committed transfers are done (and any simulated link delay has passed)."""
        with exposed():
            for req in self._reqs:
                req.wait(_wait_timeout)
            self._reqs = []
            if self._stream is not None:
                torch.cuda.current_stream().wait_stream(self._stream)
            remaining = self._committed_at + _link_delay_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)


class PeerComm:
    """Non-blocking transfers between any members of ``group`` (a local layer's halo exchange:
    each rank sends the K/V rows a peer's queries see, to that peer alone): ``send`` and
    ``recv`` queue, ``commit`` starts them all, ``wait`` blocks until they are done. Peers are
    ranks in ``group``; on CUDA the transfers run on ``stream`` as `RingComm`'s do."""

    def __init__(self, group: dist.ProcessGroup | None, stream: torch.cuda.Stream | None = None):
        if group is None:
            group = dist.group.WORLD
            assert group is not None, "torch.distributed is not initialised"
        self.group: dist.ProcessGroup = group
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []
        self._committed_at = 0.0
        self._stream = stream

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Queue sending ``tensor`` (contiguous) to group rank ``peer``."""
        peer_rank = dist.get_global_rank(self.group, peer)
        self._ops.append(dist.P2POp(dist.isend, tensor, peer_rank, self.group))

    def recv(self, buffer: torch.Tensor, peer: int) -> None:
        """Queue receiving into ``buffer`` from group rank ``peer``."""
        peer_rank = dist.get_global_rank(self.group, peer)
        self._ops.append(dist.P2POp(dist.irecv, buffer, peer_rank, self.group))

    def commit(self) -> None:
        """Start every queued transfer (nothing to do when none is queued)."""
        sends = [op.tensor.nbytes for op in self._ops if op.op is dist.isend]
        if not self._ops:
            return
        _commit_bytes[sum(sends)] += 1
        for nbytes in sends:
            _exchange_bytes[nbytes] += 1
        if self._stream is None:
            self._reqs = dist.batch_isend_irecv(self._ops)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._reqs = dist.batch_isend_irecv(self._ops)
            for op in self._ops:
                op.tensor.record_stream(self._stream)
        self._ops = []
        self._committed_at = time.perf_counter()

    def wait(self) -> None:
        """Block until the committed transfers are done (and any simulated link delay has passed)."""
        if not self._reqs:
            return
        with exposed():
            for req in self._reqs:
                req.wait(_wait_timeout)
            self._reqs = []
            if self._stream is not None:
                torch.cuda.current_stream().wait_stream(self._stream)
            remaining = self._committed_at + _link_delay_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
