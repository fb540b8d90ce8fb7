"""Exit statuses shared by the CLI, the trainer and the backends (no imports: the batch script
and the state tables read the same numbers)."""

OK = 0
FAILED = 1
"""The job or command failed; the log says why."""
BAD_INPUT = 2
"""An invalid spec or command line; nothing was started or written."""
PREEMPTED = 75
"""The trainer checkpointed on a preemption or time-limit signal and wants to be requeued
(EX_TEMPFAIL)."""
OOM = 86
"""The trainer ran out of device memory; the OOM event was exported before exiting."""
