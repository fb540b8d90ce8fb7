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


def _command(corpus: Path, out: Path, *, workers: int) -> list[str]:
    from importlib.metadata import distribution

    # Mistral 7B's SentencePiece model, shipped in mistral-common (scripts/setup installs it).
    member = "mistral_common/data/tokenizer.model.v1"
    tokenizer = Path(str(distribution("mistral_common").locate_file(member)))
    return [
        sys.executable,
        "-c",
        # Ctrl-C handled as a terminal's foreground command has it, whatever this test process
        # passes on: an inherited SIG_IGN would stay ignored (the whole-suite runs saw a group
        # SIGINT have no effect at all, exit 0 after the full run).
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from ctxlaunch.cli import main; main()",
        "data",
        "prepare",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        str(workers),
        "-o",
        str(out / "corpus"),
    ]


def _start(corpus: Path, out: Path, *, workers: int) -> subprocess.Popen[str]:
    """`data prepare` of `corpus` into the new directory `out`, in a session of its own (so
    a signal can reach its whole process group)."""
    out.mkdir()
    return subprocess.Popen(
        _command(corpus, out, workers=workers),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


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
    out = tmp_path / "out"
    process = _start(big_corpus, out, workers=workers)
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


def _workers_of(pid: int) -> list[int]:
    """The tokenizer workers among a process's children (not multiprocessing's resource
    tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = []
    for child in children:
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            found.append(int(child))
    return found


@pytest.mark.timeout(180)
def test_a_killed_worker_ends_the_run_with_its_name_and_nothing_behind(
    big_corpus: Path, tmp_path: Path
) -> None:
    """A worker killed on its own (the kernel's OOM killer, an operator's kill -9) while the
    others go on: the run stops within a bounded time, says which process ended and how, exits
    2 and leaves nothing. (A multiprocessing.Pool would start a replacement and wait for the
    lost batch forever; a worker killed while waiting for a task would hold the Pool's queue
    lock and hang its terminate.)"""
    out = tmp_path / "out"
    process = _start(big_corpus, out, workers=2)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while process.poll() is None and time.monotonic() < deadline:
        workers = _workers_of(process.pid)
        if len(workers) == 2 and any(out.iterdir()):
            break
        time.sleep(0.05)
    assert process.poll() is None, "prepare ended before a worker could be killed"
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 2, stderr
    assert f"a tokenizer worker (process {workers[0]}) ended with exit code -9" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert list(out.iterdir()) == []
