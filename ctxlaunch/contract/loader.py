"""Reading a spec: YAML text, `--set path=value` overrides, validation into a JobSpec.

Every failure is a `SpecError` that lists every problem with its field path, the value and
what is wrong, so a user fixes a spec in one pass rather than one error per run.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ctxlaunch.contract.bounded import (
    MAX_DEPTH,
    MAX_SPEC_BYTES,
    BoundedComposer,
    BoundedReadError,
    BoundedYamlError,
    SentencedConstructor,
    check_mapping_keys,
    read_bounded_text,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ctxlaunch.contract.spec import JobSpec


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec."""

    path: str
    """Dotted field path, e.g. parallel.cp or cluster.kubernetes.tolerations[0].effect."""
    message: str
    value: Any = None
    has_value: bool = False

    def __str__(self) -> str:
        shown = (
            f" (value: {_short(self.value)})" if self.has_value and self.value is not None else ""
        )
        return f"{_clip(self.path, 120) or '<spec>'}{shown}: {_bounded(self.message)}"


class SpecError(ValueError):
    """An invalid spec; `problems` lists every broken rule."""

    def __init__(self, source: str, problems: Sequence[Problem]):
        self.source = source
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{source}: invalid spec ({n} problem{'s' if n != 1 else ''})"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def read_spec_data(path: str | Path) -> dict[str, Any]:
    """Parse a spec file's YAML into a mapping (no validation yet)."""
    path = Path(path)
    try:
        text = read_bounded_text(path, MAX_SPEC_BYTES, "the spec")
    except BoundedReadError as exc:
        raise SpecError(str(path), [Problem("", str(exc).removeprefix(f"{path}: "))]) from None
    return parse_yaml(text, str(path))


class _SpecLoader(BoundedComposer, SentencedConstructor, yaml.SafeLoader):
    """YAML 1.1 reads 10:00 as the base-60 number 600; specs hold Slurm times like that, so
    numbers with colons stay strings (as in YAML 1.2). Bounded (contract/bounded.py): nesting,
    aliases expanded, keys that are text and given once, values their tags' constructors
    reject told as such."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        check_mapping_keys(node)
        return super().construct_mapping(node, deep=deep)


_SpecLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML the way specs are read (no base-60 numbers)."""
    return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader subclass


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = getattr(exc, "problem", None) or str(exc)
        kind = "" if isinstance(exc, BoundedYamlError) else "YAML syntax error at "
        raise SpecError(source, [Problem("", f"{kind}{where}{what}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(
            source,
            [
                Problem(
                    "", f"the spec must be a YAML mapping of fields, not a {type(data).__name__}"
                )
            ],
        )
    return data


def apply_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], source: str = "--set"
) -> dict[str, Any]:
    """Apply `path.to.field=value` overrides; the value is parsed as YAML (so 4 is an int,
    true a bool, [a, b] a list). Returns a new mapping; the input is not modified."""
    result = json.loads(json.dumps(data, default=str)) if data else {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(Problem("", f"--set {_clip(item, 80)!r}: expected path.to.field=value"))
            continue
        if key.count(".") >= MAX_DEPTH:
            # Deeper than any spec field, and deeper than the spec's later steps walk.
            problems.append(
                Problem(
                    "",
                    f"--set {_clip(key, 80)}: a path of {key.count('.') + 1:,} parts; a spec "
                    f"field is at most {MAX_DEPTH} deep",
                )
            )
            continue
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except BoundedYamlError as exc:
            problems.append(Problem(key, f"--set {key}: {exc.problem}"))
            continue
        except yaml.YAMLError:
            value = raw
        node = result
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                if isinstance(child, str) and i == 0 and part == "model":
                    child = node[part] = {"preset": child}  # `model: llama3-8b` shorthand
                else:
                    problems.append(
                        Problem(
                            ".".join(parts[: i + 1]),
                            f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping",
                        )
                    )
                    break
            node = child
        else:
            node[parts[-1]] = value
            # A field set under its old name replaces the field under its new one (the spec's
            # validation then reads the old name and warns).
            if parts[:-1] == ["parallel"]:
                from ctxlaunch.contract.spec import RENAMED_PARALLEL_FIELDS

                node.pop(RENAMED_PARALLEL_FIELDS.get(parts[-1], ""), None)
    if problems:
        raise SpecError(source, problems)
    return result


def validate_spec(data: Mapping[str, Any], source: str = "<spec>") -> JobSpec:
    """Validate a mapping into a JobSpec or raise SpecError with every problem."""
    # Imported here: building the spec's models is most of the CLI's start-up, and importing
    # the CLI (every `--help`) need not pay for it.
    from pydantic import ValidationError

    from ctxlaunch.contract.spec import JobSpec

    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(source, [_to_problem(err, data) for err in exc.errors()]) from None


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Read, override and validate a spec file."""
    data = apply_overrides(read_spec_data(path), overrides)
    return validate_spec(data, str(path))


def _to_problem(err: Mapping[str, Any], data: Mapping[str, Any]) -> Problem:
    loc = [part for part in err["loc"] if not _is_internal(part)]
    path = _format_path(loc)
    kind = err["type"]
    message = str(err["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind == "extra_forbidden":
        known = _known_fields(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = (
            f"unknown field{hint}. Fields allowed here: {', '.join(known)}"
            if known
            else "unknown field"
        )
        return Problem(path, message)
    if kind == "missing":
        return Problem(path, "required field is missing")
    value = err.get("input")
    return Problem(path, message, value, True)


def _is_internal(part: Any) -> bool:
    # pydantic adds validator names such as "function-after[...]" to some locations.
    return (
        isinstance(part, str)
        and ("[" in part and "]" in part and "(" not in part)
        and part.split("[", 1)[0]
        in {
            "function-after",
            "function-before",
            "function-wrap",
            "function-plain",
            "tagged-union",
            "union",
        }
    )


def _format_path(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _known_fields(loc: Sequence[Any]) -> list[str]:
    from ctxlaunch.contract.spec import JobSpec

    model: type[BaseModel] | None = JobSpec
    for part in loc:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        model = _model_of(field.annotation)
    return sorted(model.model_fields) if model is not None else []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _short(value: Any, limit: int = 80) -> str:
    return _clip(repr(value), limit)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


MESSAGE_CHARS = 600
"""The longest problem message shown: a message quotes the value it refuses, and a value may
be megabytes long."""


def _bounded(message: str) -> str:
    if len(message) <= MESSAGE_CHARS:
        return message
    return f"{message[: MESSAGE_CHARS // 2]} ... ({len(message):,} characters) ... {message[-200:]}"
