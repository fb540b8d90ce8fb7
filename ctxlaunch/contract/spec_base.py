"""What every section of the job spec shares: the strict base model, the patterns that names
and quantities must match, and the problem record that validators report (a rule, its field
and the value it rejects).

The sections live in `spec_model`, `spec_training`, `spec_parallel` and `spec_cluster`; the
rules that tie them together in `spec_rules`; `spec` assembles the job and is the public face.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import InitErrorDetails, PydanticCustomError

RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
RFC1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Values that land on `#SBATCH` lines are parsed by sbatch, not by bash, so they are restricted
# to characters that need no quoting rather than quoted.
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
SLURM_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{2}){0,2}|\d+(:\d{2}){0,2})$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
IMAGE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:@]*$")

# Pod names are "<job>-master-0" / "<job>-worker-<n>" and must stay within 63 characters.
MAX_JOB_NAME = 48

PositiveInt = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    """Unknown fields are errors: a typo must never be silently ignored.

    The docstring under each field is its description in the JSON Schema. json_schema() reads
    them when it is asked for the schema (`spec_schema`): pydantic's use_attribute_docstrings
    would read each class's source while the spec is imported, a fifth of its import time,
    paid by every command that reads a spec."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _problem(loc: tuple[str | int, ...], value: Any, message: str) -> InitErrorDetails:
    return InitErrorDetails(
        type=PydanticCustomError("layout", "{message}", {"message": message}),
        loc=loc,
        input=value,
    )


def problem_message(detail: InitErrorDetails) -> str:
    """The text of a problem made by `_problem`."""
    kind = detail["type"]
    return kind.message() if isinstance(kind, PydanticCustomError) else str(kind)
