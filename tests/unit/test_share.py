"""`ctxlaunch examples`, `dashboard` and `alerts`: the files ctxlaunch hands out, read here from
the checkout (tests/unit/test_packaging.py reads them from an installed wheel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ctxlaunch.cli import app
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS, ROOT

runner = CliRunner()
EXAMPLES = sorted(str(p.relative_to(JOBS).with_suffix("")) for p in JOBS.rglob("*.yaml"))


def run(*args: str):
    return runner.invoke(app, list(args))


def test_examples_lists_every_spec_with_what_it_is() -> None:
    result = run("examples")
    assert result.exit_code == 0
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert names == EXAMPLES
    assert "Llama-3-8B at 128K tokens on 4 H100 nodes" in result.stdout
    listed = json.loads(run("examples", "--json").stdout)
    assert [e["name"] for e in listed] == EXAMPLES and all(e["description"] for e in listed)


def test_examples_prints_one_by_name() -> None:
    for name in ("demo", "demo.yaml"):
        assert run("examples", name).stdout == (JOBS / "demo.yaml").read_text()
    assert run("examples", "sweeps/demo").stdout == (JOBS / "sweeps" / "demo.yaml").read_text()
    result = run("examples", "nonesuch")
    assert result.exit_code == 2 and "no example 'nonesuch'" in result.stderr
    assert "walk/pretrain-1k" in result.stderr


def test_examples_copies_them_and_never_overwrites_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "examples"
    assert run("examples", "-o", str(out)).exit_code == 0
    copied = sorted(str(p.relative_to(out).with_suffix("")) for p in out.rglob("*.yaml"))
    assert copied == EXAMPLES
    for name in EXAMPLES:
        assert (out / f"{name}.yaml").read_text() == (JOBS / f"{name}.yaml").read_text()
    # The sweep's base is found beside it, as in the repository.
    result = run("sweep", str(out / "sweeps" / "demo.yaml"), "--dry-run")
    assert result.exit_code == 0, result.stderr

    edited = out / "demo.yaml"
    edited.write_text("# mine\n")
    (out / "llama3-70b-1m-k8s.yaml").unlink()
    result = run("examples", "-o", str(out))
    assert result.exit_code == 2
    assert str(edited) in result.stderr and "--force" in result.stderr
    assert edited.read_text() == "# mine\n"  # nothing written, not even the missing file
    assert not (out / "llama3-70b-1m-k8s.yaml").exists()
    result = run("examples", "demo", "-o", str(out))
    assert result.exit_code == 2 and str(edited) in result.stderr
    assert run("examples", "demo", "-o", str(out), "--force").exit_code == 0
    assert edited.read_text() == (JOBS / "demo.yaml").read_text()
    assert not (out / "llama3-70b-1m-k8s.yaml").exists()  # only the one named
    taken = tmp_path / "file"
    taken.write_text("")
    assert run("examples", "-o", str(taken)).exit_code == 2


@pytest.mark.parametrize(
    ("command", "source"),
    [
        ("dashboard", ROOT / "manifests" / "grafana" / "ctxlaunch-training.json"),
        ("alerts", ROOT / "manifests" / "prometheus" / "ctxlaunch-rules.yml"),
    ],
)
def test_dashboard_and_alerts_print_or_write_the_shipped_file(
    command: str, source: Path, tmp_path: Path
) -> None:
    printed = run(command)
    assert printed.exit_code == 0 and printed.stdout == source.read_text()
    if command == "dashboard":
        assert json.loads(printed.stdout)["uid"] == "ctxlaunch-training"
    else:
        assert yaml.safe_load(printed.stdout)["groups"]
    target = tmp_path / "out.txt"
    assert run(command, "-o", str(target)).exit_code == 0
    assert target.read_text() == source.read_text()
    assert run(command, "-o", str(tmp_path)).exit_code == 0  # a directory: its own name
    assert (tmp_path / source.name).read_text() == source.read_text()
