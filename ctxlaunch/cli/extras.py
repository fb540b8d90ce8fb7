"""The optional packages: which extra installs which, and what a command says when its extra is
missing (the name of the extra and the pip line, exit 2), never a traceback.

The base install (`pip install ctxlaunch`) plans, renders, submits and watches jobs; the
commands that run torch, tokenize or draw import their packages inside the command, so a
missing one surfaces as a ModuleNotFoundError that `needs_extras` turns into the message.
pyproject.toml's [project.optional-dependencies] holds the same table
(tests/unit/test_extras.py checks that they agree and that every import is covered).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

from ctxlaunch.cli.common import fail
from ctxlaunch.contract import exitcodes

EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("torch", "deepspeed", "safetensors", "numpy"),
    "data": ("tokenizers", "sentencepiece", "tiktoken", "numpy"),
    "report": ("matplotlib",),
    "kubernetes": ("kubernetes",),
    "tensorboard": ("tensorboard",),
    "mlflow": ("mlflow",),
    "wandb": ("wandb",),
}
"""extra -> the top-level modules (import names) it installs that ctxlaunch imports."""

DISTRIBUTIONS: dict[str, str] = {"mlflow": "mlflow-skinny"}
"""Import name -> the distribution an extra lists, where the two differ."""

COMMAND_EXTRAS: dict[str, str] = {
    "train": "train",
    "eval": "train",
    "export": "train",
    "calibrate": "train",
    "submit": "train",
    "sweep": "train",
    "data prepare": "data",
    "report": "report",
}
"""The extra a command needs first, which names the extra for a module several extras hold
(numpy: `train` for the trainer, `data` for `data prepare`)."""

F = TypeVar("F", bound=Callable[..., Any])


def extra_for(module: str, command: str = "") -> str | None:
    """The extra that installs top-level module `module` (the command's own extra when it is
    one of several), or None for a module no extra holds."""
    root = module.split(".")[0]
    holders = [extra for extra, modules in EXTRAS.items() if root in modules]
    if not holders:
        return None
    own = COMMAND_EXTRAS.get(command)
    return own if own in holders else holders[0]


def install_hint(command: str, module: str, extra: str) -> str:
    """The one line a command prints when its extra is missing."""
    return f"ctxlaunch {command} needs {module}: pip install 'ctxlaunch[{extra}]'"


def missing_module(module: str) -> bool:
    """Whether top-level module `module` cannot be imported here (not installed, or hidden)."""
    try:
        return importlib.util.find_spec(module.split(".")[0]) is None
    except (ImportError, ValueError):  # a module whose __spec__ is unset or broken
        return True


def fail_missing(command: str, module: str, extra: str) -> NoReturn:
    """Exit 2 naming `extra`, the extra that installs `module`."""
    fail(install_hint(command, module.split(".")[0], extra), exitcodes.BAD_INPUT)


def require(command: str, *modules: str) -> None:
    """Exit 2 with the install line unless every one of `modules` can be imported: for the
    commands that start the trainer in other processes (eval, a local submit or sweep), where
    the missing module would otherwise fail inside the job. `command` is the command's name
    as typed (`eval`, `data prepare`)."""
    for module in modules:
        extra = extra_for(module, command)
        if extra is not None and missing_module(module):
            fail_missing(command, module, extra)


def needs_extras(name: str) -> Callable[[F], F]:
    """Wrap command `name` (as typed: `train`, `data prepare`) so that a module an extra
    installs, found missing while it runs, ends it with the extra to install and exit 2. Any
    other import error is a bug and propagates."""

    def wrap(command: F) -> F:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except ModuleNotFoundError as exc:
                module = exc.name or ""
                extra = extra_for(module, name) if module else None
                if extra is None or not missing_module(module):
                    raise
                fail_missing(name, module, extra)

        return cast(F, run)

    return wrap
