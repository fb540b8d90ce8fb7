"""A rank of a job started here (`ctxlaunch submit` of a local job, `ctxlaunch eval`) ends when
the command that started it ends, whatever ended it (ctxlaunch.contract.lifeline says how)."""

from __future__ import annotations

import os
import threading
import time

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.lifeline import LAUNCHER_ENV, ProcessId, die_with_parent

POLL_SECONDS = 1.0
"""How often the watchdog looks for the launcher: a rank outlives it by at most this long."""


def hold_to_launcher(poll_seconds: float = POLL_SECONDS) -> ProcessId | None:
    """Tie this rank to its launcher (named in LAUNCHER_ENV): the parent-death signal, a
    check that the launcher is still there, and a watchdog thread. Returns the launcher, or
    None for a rank no launcher here started (Slurm's and the pods' own supervise theirs)."""
    launcher = ProcessId.parse(os.environ.get(LAUNCHER_ENV))
    if launcher is None:
        return None
    die_with_parent()
    if not launcher.alive():
        os._exit(exitcodes.FAILED)
    threading.Thread(
        target=_watch, args=(launcher, poll_seconds), name="ctxlaunch-tether", daemon=True
    ).start()
    return launcher


def _watch(launcher: ProcessId, poll_seconds: float) -> None:
    """End the process (no clean-up to wait on: nobody is left to record it) once the
    launcher has gone."""
    while launcher.alive():
        time.sleep(poll_seconds)
    os._exit(exitcodes.FAILED)
