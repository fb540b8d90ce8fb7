"""The code passes its own linters: ruff (pyflakes, pycodestyle, import order, pyupgrade,
bugbear) and `ruff format --check` over the package, the tests, the benchmarks, devkit and the
scripts, and mypy over the package, with the settings in pyproject.toml. A `type: ignore` must
say why on its own line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

BIN = Path(sys.executable).parent


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / tool), *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


LINTED = ("ctxlaunch", "tests", "benchmarks", "devkit", "scripts")


def test_ruff() -> None:
    result = _run("ruff", "check", "--no-cache", *LINTED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    """The tree is as `ruff format` writes it: run `ruff format` and commit the result."""
    result = _run("ruff", "format", "--check", "--no-cache", *LINTED)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_mypy() -> None:
    """mypy over the package, incremental: its cache (.mypy_cache) only skips the modules
    whose sources and dependencies are unchanged since it was written (scripts/test writes it
    while the services start)."""
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_type_ignore_gives_its_reason() -> None:
    bare = []
    for path in sorted((ROOT / "ctxlaunch").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = re.search(r"#\s*type:\s*ignore(\[[^\]]*\])?(.*)$", line)
            if match and not re.search(r"#\s*\S", match.group(2)):
                bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert bare == [], "type: ignore without a reason:\n" + "\n".join(bare)


MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 100
SHORT_FUNCTION_LAYERS = ("perf", "planning", "launch")
"""The layers whose functions stay short: the models and the launchers are read most often."""


def test_modules_and_functions_stay_readable() -> None:
    """No module over MAX_MODULE_LINES lines; no function over MAX_FUNCTION_LINES lines in the
    perf, planning and launch layers."""
    import ast

    long = []
    package = ROOT / "ctxlaunch"
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(ROOT)
        if text.count("\n") > MAX_MODULE_LINES:
            long.append(f"{where}: {text.count(chr(10))} lines")
        if path.relative_to(package).parts[0] not in SHORT_FUNCTION_LAYERS:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], "too long:\n" + "\n".join(long)
