"""The progress of a long step (tensors written by `export`, tensors read from init_from when a
job starts, `calibrate`'s measurement stages), on stderr.

On a terminal it is a live bar (rich.progress) that clears itself when done. Anywhere else (a
job's log, CI, `2> file`) a bar's redraws would fill the file with carriage returns, so it is
a plain line at each tenth of the way: eleven lines at most however many items there are.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress as Bar
    from rich.progress import TaskID

LINE_STEPS = 10
"""Without a terminal, a line each time this fraction (1/LINE_STEPS) more of the work is done."""


class Progress:
    """`total` items of work called `description`, advanced as they are done:

    with Progress("export: tensors written", total=len(tensors)) as progress:
        for ...:
            progress.advance(note=name)
    """

    def __init__(
        self,
        description: str,
        total: int,
        *,
        stream: IO[str] | None = None,
        live: bool | None = None,
    ) -> None:
        """`stream` defaults to stderr; `live` (a bar rather than lines) to whether the stream
        is a terminal."""
        self.description = description
        self.total = max(total, 0)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._printed_step = -1
        self._bar: Bar | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Progress:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(file=self.stream),
                transient=True,
            )
            bar.start()
            self._task = bar.add_task(self.description, total=self.total, note="")
            self._bar = bar
        else:
            self._line("")
        return self

    def advance(self, count: int = 1, note: str = "") -> None:
        """`count` more items done; `note` says which (shown beside the bar, or in the line)."""
        self.done = min(self.done + count, self.total)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done, note=note)
        else:
            self._line(note)

    def _line(self, note: str) -> None:
        step = self.done * LINE_STEPS // self.total if self.total else LINE_STEPS
        if step <= self._printed_step:
            return
        self._printed_step = step
        percent = 100 * self.done // self.total if self.total else 100
        detail = f" ({note})" if note and self.done < self.total else ""
        self.stream.write(f"{self.description}: {percent}% ({self.done}/{self.total}){detail}\n")
        self.stream.flush()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()


class StepClock:
    """A run's progress and time left, from its own steps: the mean of the measured steps (the
    first, which warms up, left out once there are others), or the predicted step before any
    is measured. Steps resumed from a checkpoint count as done."""

    def __init__(self, total_steps: int, predicted_step_seconds: float | None = None) -> None:
        self.total_steps = max(total_steps, 1)
        self.predicted = predicted_step_seconds
        self._seconds: list[float] = []

    def record(self, step_seconds: float) -> None:
        """One more step measured."""
        self._seconds.append(step_seconds)

    @property
    def step_seconds(self) -> float | None:
        """The step the time left is counted in (None: nothing measured or predicted)."""
        timed = self._seconds[1:] or self._seconds
        if timed:
            return sum(timed) / len(timed)
        return self.predicted

    def progress(self, step: int) -> float:
        """The share of the run done after `step` steps, 0 to 1."""
        return min(max(step / self.total_steps, 0.0), 1.0)

    def remaining_seconds(self, step: int) -> float | None:
        """Seconds until the last step, after `step` steps (None: no step time known yet)."""
        step_seconds = self.step_seconds
        if step_seconds is None:
            return None
        return max(self.total_steps - step, 0) * step_seconds
