"""What every section of the job spec shares: the strict base model, the patterns that names
and quantities must match, and the problem record that validators report (a rule, its field
and the value it rejects).

The sections live in the `*_section` modules beside this one; the rules that tie them
together in `rules`; `jobspec` assembles the job, and the package is the public face.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
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

MAX_TEXT_CHARS = 4096
"""The longest string anywhere in a spec (Linux's PATH_MAX): every value may reach a batch
script, a manifest or a process environment."""
_UNSAFE_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
"""Characters no spec string may hold: control characters (a line break ends a `#SBATCH`
line or a comment and starts a command; NUL ends a C string early), the Unicode line
separators, and lone surrogates (not text: they cannot be written as UTF-8)."""
_CHARACTER_NAMES = {
    "\n": "a line break (\\n)",
    "\r": "a carriage return (\\r)",
    "\x00": "a NUL byte",
}


def text_problem(text: str) -> str | None:
    """Why `text` cannot stand in a spec (a script, a manifest, an environment), or None."""
    if len(text) > MAX_TEXT_CHARS:
        return f"is {len(text):,} characters long; a spec string holds at most {MAX_TEXT_CHARS:,}"
    found = _UNSAFE_CHARACTER.search(text)
    if found is None:
        return None
    char = found.group()
    name = _CHARACTER_NAMES.get(char, f"the control character U+{ord(char):04X}")
    return (
        f"contains {name} at character {found.start()}: a spec string is one line of text "
        "(it may land in a batch script, a manifest or an environment)"
    )


def text_problems(data: Any, loc: tuple[str | int, ...] = ()) -> list[InitErrorDetails]:
    """Every string in a spec's raw data (keys and values, at any depth) that `text_problem`
    refuses, each at its field path."""
    problems: list[InitErrorDetails] = []
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, loc)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            reason = text_problem(value)
            if reason is not None:
                problems.append(_problem(where, _preview(value), f"the value {reason}"))
        elif isinstance(value, dict):
            for key, child in value.items():
                if isinstance(key, str) and (reason := text_problem(key)) is not None:
                    problems.append(_problem(where, _preview(key), f"the key {reason}"))
                    continue
                stack.append((child, (*where, key if isinstance(key, (str, int)) else str(key))))
        elif isinstance(value, (list, tuple)):
            stack.extend((child, (*where, i)) for i, child in enumerate(value))
    return sorted(problems, key=lambda p: [str(part) for part in p["loc"]])


def _preview(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


PositiveInt = Annotated[int, Field(ge=1)]

INT64_MAX = (1 << 63) - 1
"""The largest integer a spec holds anywhere: every number lands in a 64-bit integer somewhere
(torch, a manifest's int64, a C library), where a larger one overflows or wraps."""
SEED_MAX = (1 << 32) - 1
"""The largest seed: the seed is combined with indices before it seeds torch's and Python's
generators, and numpy's take 32 bits."""
UID_MAX = (1 << 32) - 2
"""The largest user id Linux has ((uid_t) -1 means none)."""
INT32_MAX = (1 << 31) - 1
"""The largest value a C `int` holds (what NCCL reads its integer variables into)."""


def number_problem(value: Any) -> str | None:
    """Why a validated field's value holds a number no consumer can take (an integer beyond
    64 bits, an infinite or NaN float, at any depth of a list or mapping), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bool) or item is None or isinstance(item, str):
            continue
        if isinstance(item, int):
            if not -INT64_MAX - 1 <= item <= INT64_MAX:
                return (
                    f"{_number_preview(item)} is beyond the 64-bit integer range every "
                    "consumer of a spec number holds"
                )
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{item} is not a finite number"
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return None


def _number_preview(value: int) -> str:
    digits = len(str(abs(value))) if value.bit_length() < 10_000 else None
    if digits is not None and digits <= 30:
        return str(value)
    return f"an integer of {digits:,} digits" if digits else "an integer of over 3,000 digits"


class _Strict(BaseModel):
    """Unknown fields are errors: a typo must never be silently ignored. Numbers are finite
    and within 64 bits (`number_problem`): `.inf` or 2^64 passes no consumer.

    The docstring under each field is its description in the JSON Schema. json_schema() reads
    them when it is asked for the schema (`schema`): pydantic's use_attribute_docstrings
    would read each class's source while the spec is imported, a fifth of its import time,
    paid by every command that reads a spec."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False
    )

    @field_validator("*", mode="after")
    @classmethod
    def _numbers_in_range(cls, value: Any) -> Any:
        if isinstance(value, (int, float, list, tuple, dict)):
            problem = number_problem(value)
            if problem is not None:
                raise ValueError(problem)
        return value


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
