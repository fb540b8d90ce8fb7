"""The suite's service groups reach pytest-xdist: under `--dist loadgroup` (as scripts/test runs
it) every test of a group runs on one worker, so the tests that share Slurm, the node or the
API server never run side by side. Checked with the installed pytest and xdist on stand-in files
named as the real ones, whose tests only record which worker ran them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SERVICE_GROUPS

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


@pytest.mark.timeout(300)
def test_each_service_group_runs_on_one_worker(tmp_path: Path) -> None:
    files = [names[0] for names in SERVICE_GROUPS.values()] + [
        names[-1] for names in SERVICE_GROUPS.values()
    ]
    files += ["test_free_a.py", "test_free_b.py"]
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name in set(files):
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
    ran = re.findall(r"\[(gw\d+)\] .*PASSED (test_\w+\.py)::", result.stdout)
    assert len(ran) == 4 * len(set(files)), result.stdout
    workers: dict[str, set[str]] = {}
    for worker, name in ran:
        workers.setdefault(name, set()).add(worker)
    for group, names in SERVICE_GROUPS.items():
        used = set().union(*(workers[n] for n in names if n in workers))
        assert len(used) == 1, f"group {group} ran on {sorted(used)}:\n{result.stdout}"
    # The rest is shared out: with two workers and twenty-odd tests both take some.
    assert {w for w, _ in ran} == {"gw0", "gw1"}, result.stdout
