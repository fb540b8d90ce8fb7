"""The suite's service groups reach pytest-xdist: under `--dist loadgroup` (as scripts/test runs
it) every test of a group (a folder of tests/service) runs on one worker, so the tests that
share Slurm, the node or the API server never run side by side. Checked with the installed
pytest and xdist on stand-in files laid out as the real ones, whose tests only record which
worker ran them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  the hook under test
"""

STANDIN = """
import pytest

@pytest.mark.parametrize("i", range(4))
def test_case(i):
    pass
"""


SERVICE_GROUPS = sorted(
    path.name
    for path in (ROOT / "tests" / "service").iterdir()
    if path.is_dir() and path.name != "__pycache__"
)
"""The real groups: the folders of tests/service."""


@pytest.mark.timeout(300)
def test_each_service_group_runs_on_one_worker(tmp_path: Path) -> None:
    assert SERVICE_GROUPS, "no service groups found"
    files = [
        f"tests/service/{group}/test_{group}_{i}.py" for group in SERVICE_GROUPS for i in (1, 2)
    ]
    files += ["tests/unit/test_free_a.py", "tests/unit/test_free_b.py"]
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(STANDIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--import-mode=importlib",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = re.findall(r"\[(gw\d+)\] .*PASSED (?:\S+/)?(test_\w+\.py)::", result.stdout)
    assert len(ran) == 4 * len(files), result.stdout
    workers: dict[str, set[str]] = {}
    for worker, name in ran:
        workers.setdefault(name, set()).add(worker)
    for group in SERVICE_GROUPS:
        used = set().union(*(workers[f"test_{group}_{i}.py"] for i in (1, 2)))
        assert len(used) == 1, f"group {group} ran on {sorted(used)}:\n{result.stdout}"
    # The rest is shared out: with two workers and twenty-odd tests both take some.
    assert {w for w, _ in ran} == {"gw0", "gw1"}, result.stdout
