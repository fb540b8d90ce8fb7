"""`examples`, `dashboard` and `alerts`: the files ctxlaunch hands out.

In a wheel they are package data under ctxlaunch/share (pyproject.toml's force-include copies
the repository's jobs/ and manifests/ there); in a checkout (an editable install, or
PYTHONPATH) they are read from the repository itself, so the two never differ.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ctxlaunch.cli.common import err, fail, out
from ctxlaunch.contract.shipped import ShippedFileMissing, shipped

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

EXAMPLE_SUFFIX = ".yaml"


def shared(what: str) -> Traversable:
    """The shipped file or folder `what` (contract.shipped.SHIPPED); exit 2 when this
    installation has none."""
    try:
        return shipped(what)
    except ShippedFileMissing as exc:
        fail(str(exc))


@dataclass(frozen=True)
class Example:
    """One example job spec (or sweep) and what its opening comment says it is."""

    name: str
    """Its path under the examples, without .yaml: demo, sweeps/demo, walk/extend-8k."""
    file: Traversable
    description: str


def examples_list() -> list[Example]:
    """Every example spec, by name."""
    found: list[Example] = []

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(EXAMPLE_SUFFIX):
                name = prefix + entry.name.removesuffix(EXAMPLE_SUFFIX)
                found.append(Example(name, entry, _description(entry.read_text("utf-8"))))

    walk(shared("jobs"), "")
    return sorted(found, key=lambda example: example.name)


def _description(text: str) -> str:
    """The first sentence of a spec's opening comment, shortened to a table cell."""
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    sentence = " ".join(comment).split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= 100 else sentence[:97].rsplit(" ", 1)[0] + " ..."


def find_example(name: str) -> Example:
    """The example called `name` (with or without .yaml), or exit 2 listing them."""
    wanted = name.removesuffix(EXAMPLE_SUFFIX)
    known = examples_list()
    for example in known:
        if example.name == wanted:
            return example
    fail(f"no example {name!r}; the examples: {', '.join(e.name for e in known)}")


def examples(
    name: Annotated[
        str | None,
        typer.Argument(
            help="An example (see the list): print it, or with --output copy it.",
            show_default=False,
            autocompletion=lambda incomplete: [
                e.name for e in examples_list() if e.name.startswith(incomplete)
            ],
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Copy the examples (or NAME) into this directory, keeping their folders.",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="With --output: overwrite files that exist.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable list.")] = False,
) -> None:
    """The example job specs: list them, print one, or copy them into a directory.

    Copying never overwrites a file that exists unless --force: without it, it names the
    first such file, exits 2 and writes nothing."""
    from ctxlaunch.contract.fsutil import atomic_write_text

    chosen = [find_example(name)] if name else examples_list()
    if output is not None:
        if output.exists() and not output.is_dir():
            fail(f"--output: {output} exists and is not a directory")
        targets = [(output / f"{e.name}{EXAMPLE_SUFFIX}", e) for e in chosen]
        clash = next((path for path, _ in targets if path.exists()), None)
        if clash is not None and not force:
            fail(f"--output: {clash} exists; pass --force to overwrite it (nothing written)")
        for path, example in targets:
            atomic_write_text(path, example.file.read_text("utf-8"))
            err.print(f"wrote {path}", markup=False)
        return
    if name:
        sys.stdout.write(chosen[0].file.read_text("utf-8"))
        return
    if as_json:
        listed = [{"name": e.name, "description": e.description} for e in chosen]
        out.print_json(json.dumps(listed))
        return
    width = max(len(e.name) for e in chosen)
    for example in chosen:
        out.print(f"{example.name:<{width}}  {example.description}", markup=False)


OutputFileOpt = Annotated[
    str | None,
    typer.Option(
        "--output",
        "-o",
        help="Write it to this file, or into this directory (one that exists, or a path ending "
        "in /, made if missing), atomically; default: stdout.",
        show_default=False,
    ),
]


def _hand_out(what: str, output: str | None) -> None:
    """Print the shared file `what`, or write it to `output`: a file, or a directory to put it
    in under its own name (one that exists, or a path written with a trailing slash, which is
    made: `-o monitoring/` never writes a file called monitoring)."""
    import os

    from ctxlaunch.contract.fsutil import atomic_write_text

    source = shared(what)
    text = source.read_text("utf-8")
    if output is None:
        sys.stdout.write(text)
        return
    target = Path(output)
    as_folder = output.endswith((os.sep, "/")) or target.is_dir()
    if as_folder and target.exists() and not target.is_dir():
        fail(f"--output {output}: {target} exists and is not a directory")
    if not as_folder and target.is_dir():
        fail(f"--output {output}: is a directory")
    path = target / source.name if as_folder else target
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--output {output}: cannot make {path.parent} ({exc.strerror})")
    err.print(f"wrote {atomic_write_text(path, text)}", markup=False)


def dashboard(output: OutputFileOpt = None) -> None:
    """The Grafana dashboard of a training job's metrics (JSON, for Grafana's import or a
    dashboard provisioning folder)."""
    _hand_out("dashboard", output)


def alerts(output: OutputFileOpt = None) -> None:
    """The Prometheus alerting and recording rules for training jobs (a rule file for
    Prometheus' rule_files, or the spec of a PrometheusRule)."""
    _hand_out("alerts", output)
