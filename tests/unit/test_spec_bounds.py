"""Specs are read with bounds: a FIFO, an oversized file, deep nesting, an alias bomb, a key
given twice or a key that is not text end in one sentence naming the file, never a hang, a
MemoryError, a RecursionError or a TypeError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxlaunch.contract.loader import SpecError, load_spec
from tests.helpers.paths import JOBS, ROOT

ALIAS_BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}]"
        for i in range(8)
    ]
)
"""9^9 leaves from a few hundred bytes."""

ALIAS_BOMB_TEN = "\n".join(
    ["a: &a [" + ", ".join(["x"] * 10) + "]"]
    + [
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 10) + "]"
        for i in range(6)
    ]
)
"""10^7 leaves (the shape that reached a MemoryError at 3 GiB before aliases were bounded)."""


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("fifo", "a FIFO"),
        ("huge", "larger than"),
        ("deep", "deep"),
        ("alias-bomb", "values"),
        ("alias-bomb-ten", "values"),
        ("duplicate", "appears twice"),
        ("date-key", "is not text"),
        ("recursive-alias", "a recursive alias"),
    ],
)
def test_a_spec_beyond_the_bounds_is_one_sentence(kind: str, words: str, tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    demo = (JOBS / "demo.yaml").read_text()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_text(demo + "#" + "x" * (2 << 20) + "\n")
    elif kind == "deep":
        path.write_text("name: a\nx: " + "[" * 500 + "]" * 500 + "\n")
    elif kind == "alias-bomb":
        path.write_text(ALIAS_BOMB + "\n")
    elif kind == "alias-bomb-ten":
        path.write_text(ALIAS_BOMB_TEN + "\n")
    elif kind == "duplicate":
        path.write_text(demo + "\ntraining:\n  steps: 1\n")
    elif kind == "recursive-alias":
        path.write_text(demo.replace("name: ", "name: &self [*self]\n_: ", 1))
    else:
        path.write_text(demo + "\n2024-01-01: x\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert words in str(caught.value) and str(path) in str(caught.value)


def test_the_command_line_exits_2_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(ALIAS_BOMB + "\n")
    done = subprocess.run(
        [sys.executable, "-c", "from ctxlaunch.cli import main; main()", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("model.preset={}", "unknown model preset {}"),
        ("model.preset=[1]", "unknown model preset [1]"),
        ("model={}", "model"),
        ("name=" + "[" * 500 + "]" * 500, "nested"),
    ],
    ids=["preset-mapping", "preset-list", "section-emptied", "500-deep"],
)
def test_a_hostile_set_is_one_sentence(override: str, words: str) -> None:
    """`--set` values that are not what the field holds (a mapping or list for a preset's name,
    a whole section emptied, a list nested 500 deep): a SpecError naming the field, never a
    TypeError or a RecursionError."""
    with pytest.raises(SpecError) as caught:
        load_spec(JOBS / "demo.yaml", [override])
    assert words in str(caught.value), str(caught.value)
