"""Shell checks for rendered scripts: bash's own parse, then shellcheck at style severity
(the shellcheck the venv ships, where the machine has none)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


def shellcheck(path: Path) -> None:
    subprocess.run(["bash", "-n", str(path)], check=True)
    result = subprocess.run(
        [SHELLCHECK, "--severity=style", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
