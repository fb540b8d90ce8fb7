"""SIGTERM or Ctrl-C to `ctxlaunch data prepare` leaves nothing behind: no hidden temporary
files, no output, no worker tracebacks; the command says it was interrupted and exits 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSON lines long enough that tokenizing them takes a while."""
    path = tmp_path_factory.mktemp("corpus") / "big.jsonl"
    line = " ".join(f"word{i} and some more text" for i in range(200))
    with path.open("w") as stream:
        for number in range(20_000):
            stream.write(json.dumps({"text": f"{number} {line}"}) + "\n")
    return path


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("signum", "whole_group", "workers"),
    [
        (signal.SIGTERM, False, 1),
        (signal.SIGTERM, True, 2),
        (signal.SIGINT, True, 2),
    ],
    ids=["sigterm", "sigterm-group-workers", "sigint-group-workers"],
)
def test_a_signal_leaves_nothing_behind(
    big_corpus: Path, tmp_path: Path, signum: int, whole_group: bool, workers: int
) -> None:
    from importlib.metadata import distribution

    # Mistral 7B's SentencePiece model, shipped in mistral-common (scripts/setup installs it).
    member = "mistral_common/data/tokenizer.model.v1"
    tokenizer = Path(str(distribution("mistral_common").locate_file(member)))
    out = tmp_path / "out"
    out.mkdir()
    command = [
        sys.executable,
        "-c",
        "from ctxlaunch.cli import main; main()",
        "data",
        "prepare",
        str(big_corpus),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        str(workers),
        "-o",
        str(out / "corpus"),
    ]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not any(out.iterdir()) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "prepare ended before it could be interrupted"
    time.sleep(0.5)  # well into the writing
    if whole_group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    assert "interrupted; nothing was written" in stderr
    assert "Traceback" not in stderr, stderr
    assert list(out.iterdir()) == []
