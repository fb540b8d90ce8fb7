"""A calibration that knows when it cannot be trusted: beside two busy loops `calibrate` saves
nothing and says what it saw; readings that disagree, or an all-core rate below one thread's,
are named; the progress's time left comes from the calibration's own first stages."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctxlaunch.cli import app
from ctxlaunch.runtime.calibration.cpu import Stages
from ctxlaunch.runtime.calibration.trust import LoadWatch, judge, spread
from ctxlaunch.runtime.progress import Progress
from tests.helpers.cli import CliRunner

BUSY_LOOP = "while True: pass"


@pytest.mark.timeout(120)
def test_calibrate_beside_two_busy_loops_saves_nothing_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path))
    loops = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True)
        for _ in range(2)
    ]
    try:
        time.sleep(0.5)  # both loops running
        result = CliRunner().invoke(app, ["calibrate"])
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert message.startswith("error: calibrate saved nothing: other processes kept ")
    assert "cores busy" in message and "--force" in message
    assert message.count("\n") == 0  # one sentence
    assert not (tmp_path / "cpu_calibration.json").exists()


def test_a_busy_loop_is_counted_as_someone_elses() -> None:
    """The load watch, with the kernel's own accounting: a loop in a process the watch did not
    start (and has not reaped) is another's."""
    watch = LoadWatch().start()
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True)
    try:
        time.sleep(1.0)
        others = watch.others_cores()
    finally:
        loop.kill()
        loop.wait()
    assert others is not None and others > 0.5  # the loop holds (most of) a core


def test_readings_that_disagree_or_contradict_are_named() -> None:
    quiet = judge(
        others_cores=0.02,
        cores=8,
        readings={"matmul, all cores": [100e9, 102e9, 99e9]},
        all_cores={"matmul": 100e9},
        one_thread={"matmul": 20e9},
    )
    assert quiet == []
    reasons = judge(
        others_cores=1.4,
        cores=2,
        readings={"matmul, all cores": [23.9e9, 60e9, 88.0e9]},
        all_cores={"matmul": 23.9e9},
        one_thread={"matmul": 88.9e9},
    )
    assert reasons[0].startswith("other processes kept 1.4 of the 2 cores busy")
    assert (
        "the matmul, all cores readings disagree (2.39e+10, 6e+10, 8.8e+10: 107% apart"
        in (reasons[1])
    )
    assert reasons[2] == "the all-core matmul rate (23.9 G/s) is below one thread's (88.9 G/s)"
    assert spread([1.0]) == 0.0 and spread([1.0, 1.1, 1.2]) == pytest.approx(0.2 / 1.1)


def test_the_time_left_comes_from_its_own_first_stages() -> None:
    """Each stage to come takes what the last of its kind took; one of a kind not run yet the
    mean of those done."""
    stream = io.StringIO()
    progress = Progress("calibrate: measurements", total=5, stream=stream, live=False)
    stages = Stages(progress, ["compute", "model", "compute", "model", "exchange"])
    stages.done = [("compute", 20.0), ("model", 40.0)]
    assert stages.seconds_left() == 20.0 + 40.0 + 30.0
    stages.done = []
    assert stages("compute", 7) == 7
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("calibrate: measurements: 20% (1/5) (compute; about ")
    assert last.endswith(" left)")
