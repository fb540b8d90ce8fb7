"""A job's state and log read through `ctxlaunch.api` in the test's own process: what
`ctxlaunch status --json` and `ctxlaunch logs` print, from the functions those commands call,
without starting an interpreter for each read (about 0.6 s of CPU a call, where the service
tests poll twice a second for minutes). What the commands themselves print is asserted
through the CLI."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ctxlaunch import api
from ctxlaunch.contract.rundir import HOME_ENV


@contextlib.contextmanager
def environment(home: Path, **extra: str) -> Iterator[None]:
    """This process's environment with `home` as ctxlaunch's home and `extra` (KUBECONFIG),
    as the tests give them to the CLI; restored after."""
    changes = {HOME_ENV: str(home), **extra}
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def status_now(home: Path, job: str, **extra: str) -> dict:
    """What `ctxlaunch status JOB --json` prints."""
    with environment(home, **extra):
        return json.loads(json.dumps(api.status(job).to_dict()))


def log_now(home: Path, job: str, **extra: str) -> str:
    """What `ctxlaunch logs JOB` prints ("" where it fails, as the command's stdout is)."""
    with environment(home, **extra):
        try:
            return "".join(api.logs(job))
        except (api.JobNotFound, api.ApiError, api.SchedulerError):
            return ""
