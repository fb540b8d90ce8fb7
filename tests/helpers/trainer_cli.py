"""Start `ctxlaunch train` on a spec written to a file, as a launcher would (one rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def train_once(data: dict, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Write `data` as tmp_path/spec.yaml and run one rank of the trainer on it."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    exe = Path(sys.executable).parent / "ctxlaunch"
    return subprocess.run(
        [str(exe), "train", str(path), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
