"""Progress on stderr: a live bar on a terminal, a line each tenth of the way elsewhere; on
`export` (tensors written), the trainer's init_from import (rank 0, parameters loaded) and
`calibrate` (its measurement stages)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ctxlaunch.runtime.progress import Progress
from tests.helpers.checkpoints import lone_rank_env
from tests.helpers.tiny_hf import tiny_spec, write_tiny_llama

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")


def progress_lines(text: str, description: str) -> list[tuple[int, int, int]]:
    """(percent, done, total) of each line `Progress` printed for `description`."""
    pattern = re.compile(rf"^{re.escape(description)}: (\d+)% \((\d+)/(\d+)\)", re.M)
    return [(int(p), int(d), int(t)) for p, d, t in pattern.findall(text)]


@pytest.mark.parametrize("total", [3, 10, 21, 1000])
def test_without_a_terminal_a_line_each_tenth(total: int) -> None:
    stream = io.StringIO()
    with Progress("work", total=total, stream=stream) as progress:
        for i in range(total):
            progress.advance(note=f"item {i}")
    lines = progress_lines(stream.getvalue(), "work")
    assert lines[0] == (0, 0, total) and lines[-1] == (100, total, total)
    assert len(lines) == min(total, 10) + 1
    tenths = [done * 10 // total for _, done, _ in lines]
    assert tenths == sorted(set(tenths))  # one line per tenth reached, none twice
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_on_a_terminal_a_live_bar_that_clears_itself() -> None:
    master, slave = pty.openpty()
    stream = os.fdopen(slave, "w")
    try:
        with Progress("loading", total=3, stream=stream) as progress:
            assert progress.live
            for _ in range(3):
                progress.advance(note="x")
        stream.flush()
        written = b""
        while select.select([master], [], [], 0.5)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            written += chunk
    finally:
        stream.close()
        os.close(master)
    text = written.decode(errors="replace")
    assert "loading" in text and "3/3" in text
    assert "\x1b[" in text  # drawn and erased with terminal control sequences
    assert not progress_lines(text, "loading")  # no log lines on a terminal


@pytest.mark.timeout(300)
def test_init_from_import_and_export_report_their_tensors(tmp_path: Path) -> None:
    """`ctxlaunch train` from a Hugging Face checkpoint reports the parameters rank 0 loads,
    `ctxlaunch export` the tensors it writes: stderr is not a terminal here, so as lines."""
    source = tmp_path / "hf"
    tensors = write_tiny_llama(source)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(source, tmp_path / "ckpt", steps=1)))
    trained = subprocess.run(
        [CTXLAUNCH, "train", str(spec), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=240,
        env=lone_rank_env(),
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    loaded = progress_lines(trained.stderr, f"init_from {source}: parameters loaded")
    parameters = 3 + 6 * 2  # embedding, final norm, head; six per block, two blocks
    assert loaded[0] == (0, 0, parameters) and loaded[-1] == (100, parameters, parameters)
    exported = subprocess.run(
        [CTXLAUNCH, "export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    written = progress_lines(exported.stderr, "export: tensors written")
    assert written[0] == (0, 0, tensors) and written[-1] == (100, tensors, tensors)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_calibrate_reports_each_measurement_stage(capsys: pytest.CaptureFixture[str]) -> None:
    from ctxlaunch.runtime.calibration.cpu import measure

    measure(
        seq=256,
        repeats=1,
        sizes=(4096,),
        sync_ranks=(2,),
        sync_readings=1,
        rate_readings=1,
        show_progress=True,
    )
    text = capsys.readouterr().err
    lines = progress_lines(text, "calibrate: measurements")
    assert [done for _, done, _ in lines] == list(range(7)) and lines[-1][2] == 6
    # Each stage's note, then the time the stages still to come are expected to take.
    notes = re.findall(
        r"^calibrate: measurements: \d+% \(\d+/6\) \((.+?)(?:; about .+ left)?\)$", text, re.M
    )
    assert notes == [
        "compute, all cores",
        "compute, one thread",
        "gloo loopback",
        "model step, all cores",
        "model step, one thread",
    ]
