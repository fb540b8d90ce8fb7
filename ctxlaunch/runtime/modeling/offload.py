"""Checkpointed activations in host memory (training.offload.activations).

Under full checkpointing a block keeps for backward only its input; everything else is
recomputed. `ActivationOffload` moves that input to host memory as the block's forward saves it
and brings it back ahead of the block's backward:

- forward: a saved-tensor hook around the block's checkpoint sees the input it saves, copies it
  into the block's host buffer and hands autograd a handle instead, so the device copy is freed
  as soon as forward is done with it. On CUDA the buffers are pinned and the copy runs on a
  side stream after the compute stream has produced the input (and the allocator is told the
  side stream still reads it); the last block's input is kept on the device, since its
  backward comes next.
- backward: when the recomputation of block i asks for its input, the copy brought back for
  it is waited for (or, where none was started, made now), and the copy of block i - 1's
  input is started on the side stream, so it crosses the host link while block i runs its
  backward. The device thus holds at most two blocks' inputs at a time.

The host buffers, one per offloaded block, are allocated at the first step and reused by every
step after (pinning memory is slow), so the host memory a rank uses is fixed:
(blocks - 1) x tokens x hidden x the residual stream's bytes (`ctxlaunch.perf.hostmemory`).

On the CPU "host" and "device" are the same memory: the copies are still made into the separate
host buffers and back into fresh tensors, so the code path and what each side holds are the
same as on a GPU, without the streams. `host_tensors` lists the host buffers, for the memory
checks and telemetry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class _Offloaded:
    """What autograd keeps in place of a block's input that went to host memory."""

    slot: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    copied: torch.cuda.Event | None
    """Recorded on the side stream after the copy to the host (None off CUDA)."""


@dataclass
class _Kept:
    """The last block's input, kept on the device: its unpacking starts bringing back the
    input of the block before."""

    slot: int
    tensor: torch.Tensor


class ActivationOffload:
    """One rank's offload of its blocks' checkpointed inputs (see the module docstring)."""

    def __init__(self, blocks: int, device: torch.device):
        self.blocks = blocks
        """Blocks this rank runs, in forward order; the last one's input stays on the device."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None
        self._host: dict[int, torch.Tensor] = {}
        self._pending: dict[int, _Offloaded] = {}
        """Handles packed in this forward, by slot, until their backward unpacks them."""
        self._back: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        """Copies brought back ahead of their block's backward, by slot."""

    def host_tensors(self) -> list[torch.Tensor]:
        """The host buffers (one per offloaded block, once the first step has run)."""
        return list(self._host.values())

    def host_bytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(t.untyped_storage().nbytes() for t in self._host.values())

    @contextlib.contextmanager
    def saving(self, slot: int, x: torch.Tensor) -> Iterator[None]:
        """Around block `slot`'s checkpoint: its input `x`, when saved for backward, goes to
        host memory (all but the last block's)."""
        if not torch.is_grad_enabled():
            yield
            return

        # Autograd keeps the pack hook as long as what it saved: it must not hold `x` itself.
        address, shape = x.data_ptr(), x.shape

        def pack(tensor: torch.Tensor) -> object:
            if tensor.data_ptr() != address or tensor.shape != shape:
                return tensor  # the RoPE tables, shared by every block: left alone
            if slot >= self.blocks - 1:
                return _Kept(slot, tensor)
            return self._to_host(slot, tensor)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    # -- forward -------------------------------------------------------------------------------
    def _buffer(self, slot: int, tensor: torch.Tensor) -> torch.Tensor:
        host = self._host.get(slot)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.cuda)
            self._host[slot] = host
        return host

    def _to_host(self, slot: int, tensor: torch.Tensor) -> _Offloaded:
        host = self._buffer(slot, tensor)
        copied = None
        if self.stream is not None:
            # The input is produced on the compute stream: copy it once it is there, and keep
            # its memory from being reused until the side stream has read it.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            tensor.record_stream(self.stream)
        else:
            host.copy_(tensor)
        handle = _Offloaded(slot, tensor.shape, tensor.dtype, tensor.device, copied)
        self._pending[slot] = handle
        return handle

    # -- backward ------------------------------------------------------------------------------
    def _unpack(self, packed: object) -> torch.Tensor:
        # Autograd re-attaches what this returns to the saved input's place in the graph.
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Kept):
            slot, tensor = packed.slot, packed.tensor
        else:
            assert isinstance(packed, _Offloaded)
            slot = packed.slot
            brought = self._back.pop(slot, None)
            if brought is None:
                brought = self._bring_back(packed)
            tensor, ready = brought
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            self._pending.pop(slot, None)
        # The block before this one runs its backward next: start bringing its input back.
        before = self._pending.get(slot - 1)
        if before is not None and slot - 1 not in self._back:
            self._back[slot - 1] = self._bring_back(before)
        return tensor

    def _bring_back(self, packed: _Offloaded) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        host = self._host[packed.slot]
        tensor = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        if self.stream is None:
            tensor.copy_(host)
            return tensor, None
        if packed.copied is not None:
            self.stream.wait_event(packed.copied)  # the copy out must have finished
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            tensor.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        tensor.record_stream(self.stream)
        return tensor, ready
