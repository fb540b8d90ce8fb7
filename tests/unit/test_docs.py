"""The documentation site (docs/, mkdocs.yml): it builds with `mkdocs build --strict`, where any
warning fails (a broken link or anchor, a page left out of the navigation, a missing include),
and its generated pages are current: docs/reference/spec.md is what `ctxlaunch schema
--markdown` prints from the spec's JSON Schema, and docs/reference/cli.md what
scripts/dev/docs_reference.py writes from the command line's own definitions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ctxlaunch.cli import app
from ctxlaunch.cli.spec_reference import REGENERATE as REGENERATE_SPEC
from ctxlaunch.cli.spec_reference import spec_reference
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.spec import json_schema
from ctxlaunch.runtime.telemetry.metrics import METRICS
from tests.helpers.cli import CliRunner
from tests.helpers.devtools import dev_script
from tests.helpers.paths import ROOT

DOCS = ROOT / "docs"
SPEC_PAGE = DOCS / "reference" / "spec.md"
CLI_PAGE = DOCS / "reference" / "cli.md"
REGENERATE_BOTH = "python scripts/dev/docs_reference.py"
MKDOCS = Path(sys.executable).parent / "mkdocs"

docs_reference = dev_script("docs_reference")
hooks = dev_script("mkdocs_hooks")


def _differs(page: Path, command: str) -> str:
    return (
        f"{page.relative_to(ROOT)} is not what its generator writes; regenerate it with "
        f"`{command}` (from the repository root) and review the diff"
    )


# --------------------------------------------------------------------------------------------
# The generated reference pages are current.


def test_spec_reference_page_is_what_schema_markdown_prints() -> None:
    result = CliRunner().invoke(app, ["schema", "--markdown"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.stdout == spec_reference(json_schema())
    assert SPEC_PAGE.read_text(encoding="utf-8") == result.stdout, _differs(
        SPEC_PAGE, f".venv/bin/{REGENERATE_SPEC}` or `{REGENERATE_BOTH}"
    )


def test_cli_reference_page_is_current() -> None:
    expected = docs_reference.cli_reference(app)
    assert CLI_PAGE.read_text(encoding="utf-8") == expected, _differs(CLI_PAGE, REGENERATE_BOTH)


# --------------------------------------------------------------------------------------------
# The generators say everything, and say it right.


def _property_count(schema: dict[str, Any]) -> int:
    objects = [schema, *schema.get("$defs", {}).values()]
    return sum(len(o.get("properties", {})) for o in objects)


def test_spec_reference_has_a_row_for_every_field_of_every_section() -> None:
    """Every object of the schema gets a table, once, and every field of it a row: the page's
    field rows (`| `name` | ...`) are exactly as many as the schema's properties."""
    schema = json_schema()
    page = spec_reference(schema)
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == _property_count(schema)
    for name, definition in schema["$defs"].items():
        description = " ".join(definition.get("description", "").split())
        assert description.split(":")[0] in page, f"{name}'s section is missing"


def _row(page: str, section: str, field: str) -> str:
    """The row of `field` in the table under the heading that names `section`."""
    text = page.split(f"`{section}`", 1)[1] if section else page.split("## Top level", 1)[1]
    for line in text.splitlines():
        if line.startswith(f"| `{field}` |"):
            return line
    raise AssertionError(f"no row for {field} under {section}")


def test_spec_reference_states_types_defaults_and_constraints() -> None:
    page = spec_reference(json_schema())
    assert _row(page, "training", "zero_stage").startswith(
        "| `zero_stage` | integer 0 to 3 | `0` |"
    )
    assert "| `ring`, `ulysses` or `hybrid` | `ring` |" in _row(page, "parallel", "cp_algorithm")
    assert "| integer 1024 to 65535 | `9400` |" in _row(page, "telemetry", "port")
    assert "| integer ≥ 1 | required |" in _row(page, "training", "seq_len")
    assert "| number ≥ 0, < 1 | `0.0` |" in _row(page, "training.data", "eval_fraction")
    assert "| `null` |" in _row(page, "training.data", "path")  # the default, null
    assert "(#modelrope_scaling-type-yarn)" in _row(page, "model", "rope_scaling")
    # Field docstrings are the descriptions.
    assert "Tokens per sequence" in _row(page, "training", "seq_len")


def test_spec_reference_on_a_small_schema() -> None:
    """The generator alone, on a schema written here: nested sections, a list of objects, a
    discriminated union, bounds, a pattern, lengths, required fields and markup escaped."""
    schema = {
        "description": "A thing.",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
            "inner": {"$ref": "#/$defs/Inner", "default": {"size": 1}},
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "default": []},
            "shape": {
                "oneOf": [{"$ref": "#/$defs/Round"}, {"$ref": "#/$defs/Square"}],
                "discriminator": {"propertyName": "kind"},
            },
        },
        "required": ["name"],
        "$defs": {
            "Inner": {
                "description": "The inner part.",
                "properties": {
                    "size": {
                        "type": "integer",
                        "minimum": 1,
                        "default": 1,
                        "description": "a*b | c <name>",
                    },
                    "ratio": {
                        "anyOf": [{"type": "number", "exclusiveMaximum": 1}, {"type": "null"}]
                    },
                },
            },
            "Item": {"description": "One item.", "properties": {"key": {"type": "string"}}},
            "Round": {"properties": {"kind": {"const": "round"}, "radius": {"type": "number"}}},
            "Square": {"properties": {"kind": {"const": "square"}, "side": {"type": "number"}}},
        },
    }
    page = spec_reference(schema)
    assert "| `name` | string at most 8 characters, matching `^[a-z]+$` | required |  |" in page
    assert (
        "| `inner` | section [`inner`](#inner) | its fields' defaults | The inner part. |" in page
    )
    assert "| `size` | integer ≥ 1 | `1` | a\\*b \\| c &lt;name> |" in page
    assert "| `ratio` | number < 1 or `null` | none |  |" in page
    assert "| `items` | list of entries, see [`items[]`](#items-each-entry) | `[]` |" in page
    assert (
        "one of [`round`](#shape-kind-round) or [`square`](#shape-kind-square), chosen by `kind`"
        in page
    )
    for heading in ("### `items[]` (each entry)", "## `shape` (kind: round)", "## `inner`"):
        assert heading in page


def test_cli_reference_names_every_command_and_option() -> None:
    import typer

    page = CLI_PAGE.read_text(encoding="utf-8")
    sections = dict(
        (match[1], match[2])
        for match in re.finditer(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    )
    names = [name for name, _ in docs_reference._leaves(typer.main.get_command(app), "ctxlaunch")]
    assert {"ctxlaunch validate", "ctxlaunch data prepare", "ctxlaunch image check"} <= set(names)
    assert list(sections) == names
    for name, command in docs_reference._leaves(typer.main.get_command(app), "ctxlaunch"):
        for param in command.params:
            if param.param_type_name != "option":
                continue
            for opt in param.opts:
                shown = f"`{opt}`" in sections[name]
                assert shown != bool(getattr(param, "hidden", False)), (name, opt)


# --------------------------------------------------------------------------------------------
# Hand-written pages that mirror a table in the code.


def test_exit_codes_page_lists_every_exit_status() -> None:
    page = (DOCS / "reference" / "exit-codes.md").read_text(encoding="utf-8")
    statuses = {name: value for name, value in vars(exitcodes).items() if isinstance(value, int)}
    assert {"OK", "FAILED", "BAD_INPUT", "PREEMPTED", "OOM", "POD_RETRY"} <= set(statuses)
    for name, value in statuses.items():
        assert f"| {value} | `{name}` |" in page, name


def test_telemetry_guide_names_every_metric() -> None:
    page = (DOCS / "guides" / "telemetry.md").read_text(encoding="utf-8")
    missing = [m.name for m in METRICS if f"`{m.name}" not in page]
    assert missing == [], f"docs/guides/telemetry.md does not list {missing}"
    assert "## Experiment trackers" in page


def test_no_page_keeps_a_diary() -> None:
    """The pages say how things work, not when they were measured: no dates, issue numbers or
    commit hashes (figures live on the benchmarks page, which includes BENCHMARKS.md)."""
    diary = re.compile(
        r"\b20\d\d-\d\d-\d\d\b|\bissue \d+|\bPR #?\d+|"
        r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
    )
    found = [
        f"{path.relative_to(ROOT)}: {match[0]}"
        for path in sorted(DOCS.rglob("*.md"))
        for match in diary.finditer(path.read_text(encoding="utf-8"))
    ]
    assert found == []


LAB_NOTE = re.compile(
    r"""
    \b20\d\d-\d\d-\d\d\b | \bissue\s+\d+ | \brun\s+\d+\b | \bruns\s+\d+ | \bat\s+[0-9a-f]{7}\b
    | BENCHMARKS(\.md)?,?\s+(section\s+)?\d
    | \bon\s+(a|the|this|that)\s+\d+-(v?cpu|core) | \bthat\s+machine\b | \bthe\s+test\s+cluster\b
    | \bthis\s+machine.s\s+(run|reading)
    """,
    re.IGNORECASE | re.VERBOSE,
)
"""What the project's reviewers flag (the before-stop hook's pattern, across line breaks): a
date, an issue or run number, a commit, a BENCHMARKS section number or a particular machine."""


def lab_notes(paths: list[Path], base: Path = ROOT) -> list[str]:
    """Each lab note in `paths`, as `file:line: text` (the file relative to `base`)."""
    found = []
    for path in paths:
        # A comment's continuation marks out of the way, so a phrase reads across them (the
        # line count stays).
        text = re.sub(r"(?m)^[ \t]*#+", "", path.read_text(encoding="utf-8"))
        for match in LAB_NOTE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(base)}:{line}: {' '.join(match[0].split())}")
    return found


def test_no_module_page_or_readme_keeps_lab_notes() -> None:
    """The package, the README and the docs say what the code does and why, in general terms:
    the reader has neither the machine a note was taken on nor its date or run. A reading goes
    to BENCHMARKS.md with its command, or beside its constant as data (perf/fitted/*.json)."""
    paths = [*sorted((ROOT / "ctxlaunch").rglob("*.py")), ROOT / "README.md"]
    found = lab_notes([*paths, *sorted(DOCS.rglob("*.md"))])
    assert found == [], "say the rule, not where it was seen:\n" + "\n".join(found)


def test_the_lab_note_check_finds_each_form(tmp_path: Path) -> None:
    """The check above can fail: each form is caught, also across a line break; a rule in
    general terms is not."""
    notes = [
        "on a 2-vCPU machine",
        "on a 16-core machine",
        "lost in that\n# machine's noise",
        "measured on the test cluster",
        "this machine's reading",
        "on 2026-12-04",
        "see issue 12",
        "BENCHMARKS section 4",
        "the self-check's run 10",
        "fixed at 5a1b6fd",
    ]
    module = tmp_path / "probe.py"
    module.write_text("\n".join(f"# {note}" for note in notes) + "\n# on every core of a machine\n")
    found = lab_notes([module], base=tmp_path)
    assert [note.split(":")[1] for note in found] == [
        "1",
        "2",
        "3",
        "5",
        "6",
        "7",
        "8",
        "9",
        "10",
        "11",
    ]


# --------------------------------------------------------------------------------------------
# The site.


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return [page for item in nav for page in _nav_pages(item)]


def test_the_navigation_lists_every_page_once() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    listed = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages


def test_repository_links_of_the_included_files_point_into_the_site() -> None:
    """The hook that rewrites the links BENCHMARKS.md and RELIABILITY.md make relative to the
    repository root, on the pages that include them (and only there)."""
    lines = [
        "see [RELIABILITY.md](RELIABILITY.md#the-table), ![plot](docs/img/mfu.png)",
        "[the config](pyproject.toml) and [`pyproject.toml`](pyproject.toml)",
        "[nowhere](no/such/file.py) and [a site](https://example.com/x)",
    ]
    rewrite = hooks._RepositoryLinks(None)
    hooks.on_page_markdown("", _Page("benchmarks.md"))
    assert rewrite.run(lines) == [
        "see [RELIABILITY.md](reliability.md#the-table), ![plot](img/mfu.png)",
        "the config and `pyproject.toml`",
        "[nowhere](no/such/file.py) and [a site](https://example.com/x)",
    ]
    hooks.on_page_markdown("", _Page("guides/slurm.md"))
    assert rewrite.run(lines) == lines


def _section_headings(markdown: str) -> int:
    """The `## ` headings of a Markdown text, outside fenced code."""
    count, fenced = 0, False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            count += 1
    return count


class _Page:
    def __init__(self, src_uri: str) -> None:
        self.file = type("File", (), {"src_uri": src_uri})()


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The includes really included the top-level files: every section heading is there.
    for page, source in (("benchmarks", "BENCHMARKS.md"), ("reliability", "RELIABILITY.md")):
        html = (site / page / "index.html").read_text(encoding="utf-8")
        sections = _section_headings((ROOT / source).read_text(encoding="utf-8"))
        assert sections > 0 and html.count("<h2 ") == sections, page
        assert "--8&lt;--" not in html and "--8<--" not in html, page
    assert "cp_algorithm" in (site / "reference" / "spec" / "index.html").read_text()
