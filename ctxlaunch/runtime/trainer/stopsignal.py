"""Stop signals, caught from the first moments of a rank: SIGUSR1 (Slurm's warning before a
time limit, forwarded by the batch script) and SIGTERM (preemption).

A signal that arrives while torch imports or the model builds must not kill the rank (Python's
default for SIGUSR1 is to die, and the work since the last checkpoint with it): it is recorded
here, and the training loop stops after its next step with a checkpoint."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_received: list[int] = []


def install() -> None:
    """Record stop signals from now on (idempotent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: _received.append(signum))


def received() -> int | None:
    """The last stop signal received, if any."""
    return _received[-1] if _received else None
