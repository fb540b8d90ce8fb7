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

POD_RETRY = 128 + 15
"""What a PyTorchJob pod exits with for PREEMPTED. The pods run under the training operator's
restartPolicy ExitCode, whose rule (kubeflow/training-operator, train_util.IsRetryableExitCode)
is: 128-255 retryable (the pod is replaced), 1-127 permanent (the job fails). So a checkpointed
stop reports 128 + SIGTERM, as a pod killed by SIGTERM would, and is restarted and resumes;
BAD_INPUT (2), OOM (86) and FAILED (1) end the job instead of looping to the backoff limit."""


def pod_exit_status(code: int) -> int:
    """The container's exit status for the trainer's combined status (see POD_RETRY)."""
    return POD_RETRY if code == PREEMPTED else code
