"""typer's CliRunner, building the click command from the app once per app.

typer's own runner rebuilds the click command on every `invoke`, evaluating every parameter's
annotations again (about 40 ms of CPU a call, most of an in-process `validate`); the app does
not change within a test session, so the command is made once and reused."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
import typer.testing
from typer.testing import Result


@functools.cache
def _command(app: typer.Typer) -> Any:
    return typer.main.get_command(app)


@contextmanager
def _cached_commands() -> Iterator[None]:
    built = typer.testing._get_command
    typer.testing._get_command = _command
    try:
        yield
    finally:
        typer.testing._get_command = built


class CliRunner(typer.testing.CliRunner):
    def invoke(self, app: typer.Typer, *args: Any, **kwargs: Any) -> Result:
        with _cached_commands():
            return super().invoke(app, *args, **kwargs)
