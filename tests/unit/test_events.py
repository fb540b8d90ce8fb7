"""The job's events file (contract.events): what the trainer writes, what the batch script's
printf line writes, and what `status` reads back are one format."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ctxlaunch.contract import events


def test_written_events_read_back_in_order(tmp_path: Path) -> None:
    assert events.append_event(tmp_path, events.STARTED, restart=0, world_size=2)
    assert events.append_event(tmp_path, events.CHECKPOINT, step=4, path="/c/step-00000004")
    with open(events.events_path(tmp_path), "a", encoding="utf-8") as handle:
        handle.write('{"event":"step","ti')  # a line half written when the job was killed
    read = events.read_events(tmp_path)
    assert [e.kind for e in read] == [events.STARTED, events.CHECKPOINT]
    assert read[1].get("step") == 4 and read[1].get("path") == "/c/step-00000004"


def test_unknown_kinds_and_fields_are_refused() -> None:
    with pytest.raises(ValueError):
        events.event_line("restarted")
    with pytest.raises(ValueError):
        events.event_line(events.STEP, step=1, lr=0.1)


def test_a_lost_event_never_fails_the_job(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert not events.append_event(tmp_path / "file" / "run", events.STOP_SIGNAL, step=3)


def test_the_batch_scripts_requeue_line_writes_the_same_event(tmp_path: Path) -> None:
    line = events.requeue_printf(
        f'"{tmp_path}"/{events.EVENTS_FILE}', "restarts", "cause", "status"
    )
    script = (
        'set -euo pipefail; restarts=1; cause="SIGUSR1 to the batch script"; status=75; '
        + line
        + "; "
        + line.replace(str(tmp_path), str(tmp_path / "missing" / "x"))
        + "; echo alive"
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout == "alive\n" and result.stderr == ""
    (requeue,) = events.read_events(tmp_path)
    assert requeue.kind == events.REQUEUE
    assert requeue.fields == {"restart": 1, "cause": "SIGUSR1 to the batch script", "exit": 75}
    expected = events.parse_events(
        [events.event_line(events.REQUEUE, restart=1, cause="SIGUSR1 to the batch script", exit=75)]
    )
    assert expected[0].fields == requeue.fields
