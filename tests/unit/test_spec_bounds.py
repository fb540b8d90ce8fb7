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


CONSTRUCTOR_REJECTS = {
    "5000-digits": ("9" * 5000, "cannot be read as an integer"),
    "int-tag": ("!!int abc", "'abc' cannot be read as an integer"),
    "impossible-date": ("2024-02-30", "'2024-02-30' cannot be read as a date"),
}
"""Values PyYAML's constructors refuse with a ValueError of their own, not its error type."""


@pytest.mark.parametrize("case", sorted(CONSTRUCTOR_REJECTS))
def test_a_value_the_yaml_constructor_rejects_is_one_sentence(case: str, tmp_path: Path) -> None:
    """In a file (with its line) and through `--set` (with its path): a SpecError naming the
    value and what it cannot be, never the constructor's ValueError."""
    value, words = CONSTRUCTOR_REJECTS[case]
    path = tmp_path / "job.yaml"
    path.write_text((JOBS / "demo.yaml").read_text().replace("steps: 60", f"steps: {value}"))
    with pytest.raises(SpecError) as in_file:
        load_spec(path)
    assert words in str(in_file.value) and "line 14" in str(in_file.value), str(in_file.value)
    with pytest.raises(SpecError) as in_set:
        load_spec(JOBS / "demo.yaml", [f"training.steps={value}"])
    text = str(in_set.value)
    assert "--set training.steps: " in text and words in text and "Traceback" not in text, text


def test_a_set_path_deeper_than_any_field_is_one_sentence() -> None:
    """A `--set` path of 2,000 parts is refused by its length before anything walks it (it
    ended in a RecursionError)."""
    with pytest.raises(SpecError) as caught:
        load_spec(JOBS / "demo.yaml", [".".join(["a"] * 2000) + "=1"])
    assert "a path of 2,000 parts; a spec field is at most 64 deep" in str(caught.value)


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("training.optimizer.lr=.inf", "finite number"),
        ("model.rope_theta=.inf", "finite number"),
        ("model.norm_eps=.inf", "finite number"),
        ("telemetry.push_interval_seconds=.inf", "finite number"),
        ("cluster.host_memory_gib=.inf", "finite number"),
        ("training.optimizer.lr=.nan", "finite number"),
        (f"training.seed={2**64}", "less than or equal to 4294967295"),
        (f"training.seed={2**32}", "less than or equal to 4294967295"),
        (f"cluster.kubernetes.run_as_user={2**64}", "less than or equal to 4294967294"),
        (f"training.steps={2**64}", "64-bit integer range"),
        (f"cluster.kubernetes.run_as_user={2**32 - 1}", "less than or equal to 4294967294"),
        (f"fabric.gid_index={2**64}", "less than or equal to 2147483647"),
        (f"fabric.gid_index={2**31}", "less than or equal to 2147483647"),
        ("training.eval.passkey.trials=1000000000", "15,000,000,000 probes"),
        ("training.eval.buckets=1000000000", "less than or equal to 64"),
        ("training.eval.sequences=1000000000", "less than or equal to 1000"),
    ],
)
def test_a_number_no_consumer_holds_is_refused(override: str, words: str) -> None:
    """Numbers are finite and within the range of what reads them (int64 everywhere, uids,
    NCCL's int, the seed's 32 bits); a passkey grid is bounded: each refused naming the
    field (`.inf` validated, then `plan` overflowed; 2^64 reached the manifest)."""
    field = override.split("=", 1)[0]
    with pytest.raises(SpecError) as caught:
        load_spec(JOBS / "demo.yaml", [override])
    text = str(caught.value)
    assert words in text and field.rsplit(".", 1)[0] in text, text
