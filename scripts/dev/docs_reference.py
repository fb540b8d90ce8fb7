"""Writes the generated reference pages of the docs site:

- docs/reference/cli.md, every command with its arguments and options, read from the command
  line's own definitions (the typer app: each command's help, its parameters' names, help,
  defaults and bounds, their types from the command function's annotations);
- docs/reference/spec.md, the job spec from its JSON Schema (what `ctxlaunch schema --markdown`
  prints).

tests/unit/test_docs.py fails when a committed page differs from what this writes. Run from the
repository root after changing a command or a spec field:

    .venv/bin/python scripts/dev/docs_reference.py
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLI_PAGE = Path("docs/reference/cli.md")
SPEC_PAGE = Path("docs/reference/spec.md")
"""Where `main()` writes the pages, relative to the repository root."""
REGENERATE = "python scripts/dev/docs_reference.py"

TYPE_NAMES: dict[Any, str] = {
    Path: "path",
    str: "text",
    int: "integer",
    float: "number",
    bool: "flag",
}
"""How a parameter's Python type reads on the page."""


def cli_reference(app: Any) -> str:
    """The command-line reference page of the typer app `app` (ctxlaunch.cli.app)."""
    import typer

    from ctxlaunch.cli.spec_reference import cell_text, heading_anchor

    root = typer.main.get_command(app)
    commands = list(_leaves(root, "ctxlaunch"))
    lines = [
        "# Command-line reference",
        "",
        f"<!-- Generated from the command line's definitions: do not edit; run `{REGENERATE}`. -->",
        "",
        cell_text(root.help or ""),
        "",
        "Every command with its arguments and options; `ctxlaunch COMMAND --help` prints the "
        "same. `SPEC` is a job spec (YAML, see the [spec reference](spec.md)); `JOB` is "
        "ctxlaunch's job id or the scheduler's (the Slurm job id, or `namespace/name` on "
        "Kubernetes). Job records live under `$CTXLAUNCH_HOME/jobs` (default `~/.ctxlaunch`). "
        "Exit statuses: [exit codes](exit-codes.md).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name, command in commands:
        summary = cell_text(_first_paragraph(command.help or ""))
        lines.append(f"| [`{name}`](#{heading_anchor(name)}) | {summary} |")
    visible = [p for p in root.params if not getattr(p, "hidden", False)]
    if visible:
        options = ", ".join(f"`{' '.join(p.opts)}` ({cell_text(p.help or '')})" for p in visible)
        lines += ["", f"Options before any command: {options}"]
    for name, command in commands:
        lines += ["", *_command_lines(name, command)]
    return "\n".join(lines).rstrip() + "\n"


def _leaves(command: Any, name: str) -> typing.Iterator[tuple[str, Any]]:
    """(full name, command) of every command under `command`, groups opened, in the order they
    were registered (the order `ctxlaunch --help` lists them)."""
    for sub_name, sub in getattr(command, "commands", {}).items():
        if getattr(sub, "hidden", False):
            continue
        full = f"{name} {sub_name}"
        if getattr(sub, "commands", None):
            yield from _leaves(sub, full)
        else:
            yield full, sub


def _command_lines(name: str, command: Any) -> list[str]:
    from ctxlaunch.cli.spec_reference import cell_text

    hints = typing.get_type_hints(inspect.unwrap(command.callback))
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    options = [p for p in params if p.param_type_name == "option"]
    usage = [name] + (["[OPTIONS]"] if options else []) + [_metavar(p) for p in arguments]
    lines = [f"## `{name}`", ""]
    for paragraph in _paragraphs(command.help or ""):
        lines += [cell_text(paragraph), ""]
    lines += ["```text", " ".join(usage), "```"]
    if not params:
        return lines
    lines += ["", "| argument or option | type | default | description |", "|---|---|---|---|"]
    for param in arguments + options:
        names = (
            [_metavar(param)]
            if param.param_type_name == "argument"
            else [*param.opts, *param.secondary_opts]
        )
        shown = ", ".join(f"`{n}`" for n in names)
        kind = _type(hints.get(param.name), param)
        lines.append(f"| {shown} | {kind} | {_default(param)} | {cell_text(param.help or '')} |")
    return lines


def _metavar(param: Any) -> str:
    """How an argument reads in the usage line: SPEC, [SPEC] (optional), INPUTS... (many)."""
    text = param.name.upper() + ("..." if param.nargs == -1 else "")
    return text if param.required else f"[{text}]"


def _type(annotation: Any, param: Any) -> str:
    """The parameter's type from its annotation, with its lower bound and repeatability."""
    repeatable = False
    while True:
        origin = typing.get_origin(annotation)
        arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
        if origin in (typing.Union, types.UnionType) and len(arguments) == 1:
            annotation = arguments[0]
        elif origin is list and arguments:
            annotation, repeatable = arguments[0], True
        else:
            break
    text = TYPE_NAMES.get(annotation, getattr(annotation, "__name__", "text"))
    low = getattr(param, "min", None)
    if low is None:  # click keeps the bound on the parameter's type (IntRange)
        low = getattr(getattr(param, "type", None), "min", None)
    if low is not None:
        text += f" ≥ {low}"
    return text + (", repeatable" if repeatable else "")


def _default(param: Any) -> str:
    if param.required:
        return "required"
    if getattr(param, "is_flag", False) or param.default is None or param.default == ():
        return ""
    return f"`{param.default}`"


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n") if p.strip()]


def _first_paragraph(text: str) -> str:
    paragraphs = _paragraphs(text)
    return paragraphs[0] if paragraphs else ""


def main() -> None:
    """Write docs/reference/cli.md and docs/reference/spec.md."""
    sys.path.insert(0, str(ROOT))
    from ctxlaunch.cli import app
    from ctxlaunch.cli.spec_reference import spec_reference
    from ctxlaunch.contract.spec import json_schema

    for page, text in ((CLI_PAGE, cli_reference(app)), (SPEC_PAGE, spec_reference(json_schema()))):
        path = ROOT / page
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {page} ({len(text):,} characters)")


if __name__ == "__main__":
    main()
