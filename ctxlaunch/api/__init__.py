"""ctxlaunch as a library: typed functions for notebooks and pipelines, the same calls the
command line makes. No function prints or exits: each returns a result or raises one of
`ApiError` (bad input, one sentence), `SpecError` (every problem of a spec), `JobNotFound` or
`SchedulerError`.

    from ctxlaunch import api

    job = api.load_spec("jobs/demo.yaml", ["training.steps=4"])
    report = api.plan(job)
    print(report.accounting.summary())
"""

from __future__ import annotations

from ctxlaunch.api.errors import ApiError, JobNotFound, Problem, SchedulerError, SpecError
from ctxlaunch.api.init_api import Started, init_spec
from ctxlaunch.api.job_api import (
    JobStatus,
    Rendered,
    Submitted,
    backend_for,
    cancel,
    logs,
    render,
    report,
    status,
    submit,
    wait,
)
from ctxlaunch.api.plan_api import advise, plan
from ctxlaunch.api.spec_api import SpecLike, Validation, build_spec, load_spec, spec_data, validate

__all__ = [
    "ApiError",
    "JobNotFound",
    "JobStatus",
    "Problem",
    "Rendered",
    "SchedulerError",
    "SpecError",
    "SpecLike",
    "Started",
    "Submitted",
    "Validation",
    "advise",
    "backend_for",
    "build_spec",
    "cancel",
    "init_spec",
    "load_spec",
    "logs",
    "plan",
    "render",
    "report",
    "spec_data",
    "status",
    "submit",
    "validate",
    "wait",
]
