"""Measure the trainer's memory: what autograd keeps for backward, and the allocator's peak.

    with SavedTensorMeter(exclude=model.parameters()) as meter:
        loss = model(...)
    meter.bytes   # unique storages saved for backward, parameters excluded

Tensors that share a storage (views, chunks) count once, as they do in memory.

    with AllocatorTrace() as trace:
        with phase("step 2/backward"):
            loss.backward()
    trace.peak_bytes, trace.peak_phase, trace.phase_peaks

`AllocatorTrace` rebuilds the live-bytes curve from the allocator's own record: the torch
profiler with profile_memory=True reports every allocation (positive size) and free (negative)
of the c10 allocator with its time, so the running sum is the allocated bytes at every moment
(from zero at the trace's start: build the model inside the trace to count everything) and
its maximum the peak that `torch.cuda.max_memory_allocated` reports on a GPU. Memory outside the
c10 allocator (gloo's and oneDNN's own scratch, the Python heap) is not seen; on CUDA the
caching allocator's rounding and fragmentation come on top (ctxlaunch/perf/memory.py).
The profiler records memory events per thread: a tensor freed on another thread (gloo's work
threads drop their references there) shows no free. Its block is taken off the curve when the
allocator hands the same address out again (which it does only once the block is free); until
then the curve reads high by its size (`unseen_frees` counts them). Before this, TP 2's
measured peaks moved by up to 10 MB between identical runs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import JobSpec
    from ctxlaunch.runtime.data.batches import MicroBatch
    from ctxlaunch.runtime.parallel.context import ParallelContext

PHASE_PREFIX = "ctxlaunch.phase:"


class SavedTensorMeter:
    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._exclude and storage.nbytes() > 0:
            self._storages[key] = storage.nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of a step ("step 2/backward") for `AllocatorTrace`; a no-op cost outside a
    trace (a profiler annotation)."""
    with torch.profiler.record_function(PHASE_PREFIX + name):
        yield


class AllocatorTrace:
    """The allocator's live bytes over a region, from the profiler's memory events; see the
    module docstring. After the `with`: `peak_bytes`, `peak_phase` (the innermost `phase` open
    at the peak, "" outside any), `phase_peaks` (the highest live bytes reached inside each
    phase, by name) and `final_bytes` (still allocated at the end)."""

    def __init__(self) -> None:
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self.peak_bytes = 0
        self.peak_phase = ""
        self.final_bytes = 0
        self.phase_peaks: dict[str, int] = {}
        self.host_bytes = 0
        """What the engine keeps in host memory by training.offload after the last step
        (unique storages of `Engine.host_tensors`); `measure_training_peak` sets it."""
        self.unseen_frees = 0
        """Blocks whose free the record missed (freed on a thread the profiler does not
        follow), taken off the curve when the allocator hands their address out again."""
        self.live_at_peak: list[tuple[int, str, str]] = []
        self.curve: list[tuple[int, int, str, str]] = []
        """Every allocation (+) and free (-) in order: (bytes, live bytes after it, op, phase)."""

    def __enter__(self) -> AllocatorTrace:
        gc.collect()  # what earlier work left to the collector is freed outside the record
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self._rebuild()

    def _rebuild(self) -> None:
        profiler = self._profiler.profiler
        results = profiler.kineto_results if profiler is not None else None
        if results is None:
            raise RuntimeError("the profiler recorded nothing")
        events = []  # (time, order, size, address, op, phase)
        stack = [(node, "", "") for node in results.experimental_event_tree()]
        while stack:
            node, op, current = stack.pop()
            name = str(node.name)
            if name.startswith(PHASE_PREFIX):
                current = name[len(PHASE_PREFIX) :]
            fields = node.extra_fields
            if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):
                events.append(
                    (node.start_time_ns, fields.id, fields.alloc_size, fields.ptr, op, current)
                )
            elif not name.startswith(PHASE_PREFIX):
                op = name
            stack.extend((child, op, current) for child in node.children)
        events.sort(key=lambda event: event[:2])
        live = 0
        held: dict[int, tuple[int, str, str]] = {}
        for _, _, size, address, op, name in events:
            if size > 0:
                stale = held.pop(address, None)
                if stale is not None:
                    # The allocator hands out an address only once it is free: this block's
                    # free happened where the profiler does not record (its memory events are
                    # per thread: a tensor released on gloo's or the autograd engine's own
                    # thread), so it leaves the curve here, at the latest.
                    live -= stale[0]
                    self.unseen_frees += 1
                held[address] = (size, op, name)
            elif held.pop(address, None) is None:
                continue  # allocated before the trace began (a previous run's, freed by gc)
            live += size
            self.curve.append((size, live, op, name))
            if live > self.peak_bytes:
                self.peak_bytes, self.peak_phase = live, name
                self.live_at_peak = list(held.values())
            if name and live > self.phase_peaks.get(name, 0):
                self.phase_peaks[name] = live
        self.final_bytes = live
        self.live_at_peak.sort(reverse=True)


def measure_training_peak(spec: JobSpec, ctx: ParallelContext, steps: int = 2) -> AllocatorTrace:
    """Build the trainer for this rank and run `steps` steps (CPU) inside an `AllocatorTrace`:
    everything the rank allocates is in the record, from the model's weights on. Phases: "build",
    then "step N/micro-batches" (forward and backward), "step N/gradients" (their reduction)
    and "step N/optimizer" (clipping, AdamW, zero_grad). The steady-state peak is step 2's:
    the Adam states exist from the first step on."""
    from ctxlaunch.runtime.trainer.loop import Trainer

    with AllocatorTrace() as trace:
        with phase("build"):
            trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
        engine = trainer.engine
        run, finish, apply = engine.run_micro_batches, engine.finish_gradients, engine.apply
        for step in range(1, steps + 1):

            def run_marked(
                batches: list[MicroBatch], predicted_tokens: int, step: int = step
            ) -> list[torch.Tensor]:
                with phase(f"step {step}/micro-batches"):
                    return run(batches, predicted_tokens)

            def finish_marked(step: int = step) -> None:
                with phase(f"step {step}/gradients"):
                    finish()

            def apply_marked(step: int = step) -> float | torch.Tensor:
                with phase(f"step {step}/optimizer"):
                    return apply()

            # The engine's own methods, wrapped for this step (instance attributes shadow them).
            setattr(engine, "run_micro_batches", run_marked)  # noqa: B010
            setattr(engine, "finish_gradients", finish_marked)  # noqa: B010
            setattr(engine, "apply", apply_marked)  # noqa: B010
            trainer.train_step()
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in engine.host_tensors()
        }
    trace.host_bytes = sum(storages.values())
    return trace
