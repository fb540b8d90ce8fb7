"""What the API raises: bad input (`ApiError`, with the one sentence the CLI prints), an invalid
spec (`contract.loader.SpecError`, every problem listed), a job it does not know
(`JobNotFound`), and a scheduler that refused or could not be asked (`SchedulerError`). None
of them prints or exits: the caller decides."""

from __future__ import annotations

from ctxlaunch.contract.loader import Problem, SpecError

__all__ = ["ApiError", "JobNotFound", "Problem", "SchedulerError", "SpecError"]


class ApiError(ValueError):
    """Bad input to an API call: the message names the argument or field and the reason."""


class JobNotFound(KeyError):
    """No job of that id (ctxlaunch's or the scheduler's) is recorded on this machine, or the
    scheduler no longer knows it."""

    def __str__(self) -> str:  # KeyError quotes its argument; this is a sentence
        return str(self.args[0]) if self.args else "no such job"


class SchedulerError(RuntimeError):
    """The scheduler refused the request or could not be asked (the message says which)."""
