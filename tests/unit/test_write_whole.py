"""Rendered files are written whole or not at all: a failure or an interrupt part way leaves
neither the files written so far nor the directories made for them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ctxlaunch.contract import fsutil
from tests.helpers.paths import JOBS, ROOT


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_failed_write_removes_what_it_made(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where a directory is needed")
    files = {
        tmp_path / "new" / "deeper" / "a.txt": (b"a", 0o644),
        tmp_path / "blocker" / "b.txt": (b"b", 0o644),
    }
    with pytest.raises(fsutil.WriteFailed, match="blocker"):
        fsutil.write_files_whole(files)
    assert tree(tmp_path) == ["blocker"]


def test_sigterm_part_way_removes_what_it_made(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The signal is real (sent to this process); the wrapper only picks the moment: after
    the first file is written, before the second."""
    real_write = fsutil.atomic_write_bytes
    calls: list[Path] = []

    def write_then_signal(path: Path, data: bytes, mode: int = 0o644) -> Path:
        if calls:
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(path)
        return real_write(path, data, mode)

    monkeypatch.setattr(fsutil, "atomic_write_bytes", write_then_signal)
    files = {tmp_path / "out" / name: (b"x", 0o644) for name in ("a", "b", "c")}
    with pytest.raises(KeyboardInterrupt):
        fsutil.write_files_whole(files)
    assert tree(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler before is back


def test_existing_files_and_directories_are_kept(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    written = fsutil.write_files_whole({tmp_path / "out" / "a.txt": (b"a", 0o644)})
    assert written == [tmp_path / "out" / "a.txt"]
    assert tree(tmp_path) == ["out", "out/a.txt", "out/keep.txt"]


def test_render_into_an_impossible_place_says_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ctxlaunch.cli import main; main()",
            "render",
            str(JOBS / "llama3-70b-1m-k8s.yaml"),
            "--monitoring",
            "-o",
            str(tmp_path / "made" / "file-below"),
            "--set",
            "telemetry.prometheus=scrape",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")},
    )
    assert done.returncode == 0, done.stderr  # the control: it writes there
    (tmp_path / "made2").mkdir()
    (tmp_path / "made2" / "monitoring").write_text("a file where a directory is needed")
    before = tree(tmp_path / "made2")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ctxlaunch.cli import main; main()",
            "render",
            str(JOBS / "llama3-70b-1m-k8s.yaml"),
            "--monitoring",
            "-o",
            str(tmp_path / "made2"),
            "--set",
            "telemetry.prometheus=scrape",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")},
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "nothing was written" in done.stderr
    assert tree(tmp_path / "made2") == before


def test_sigterm_mid_export_leaves_no_partial_directory(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The signal is real (sent to this process while the first shard is written); the
    wrapper around safetensors' save_file only picks the moment."""
    import safetensors.torch

    from ctxlaunch.cli import app
    from tests.helpers.checkpoints import tiny_job, train
    from tests.helpers.cli import CliRunner

    spec = tiny_job(tmp_path / "job")
    trained = train(spec, tmp_path / "run")
    assert trained.returncode == 0, trained.stderr
    real_save = safetensors.torch.save_file

    def save_then_signal(*args, **kwargs):  # type: ignore[no-untyped-def]
        real_save(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_signal)
    out = tmp_path / "new" / "deeper" / "exported"
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "job" / "checkpoints"), "--hf", str(out)]
    )
    assert result.exit_code == 1, result.output
    assert "interrupted; nothing was written" in result.output
    assert not (tmp_path / "new").exists()  # nor the directories made for it


def test_export_onto_a_full_disk_names_the_write(tmp_path: Path) -> None:
    """A shard write that fails, as on a full disk: the kernel's file-size limit (RLIMIT_FSIZE,
    with SIGXFSZ ignored so the write returns EFBIG) stops safetensors part way. Exit 2 naming
    the output's file, not the checkpoint, and no partial directory left, nor the directories
    made for it."""
    import resource

    from tests.helpers.checkpoints import tiny_job, train

    spec = tiny_job(tmp_path / "job")
    trained = train(spec, tmp_path / "run")
    assert trained.returncode == 0, trained.stderr
    out = tmp_path / "new" / "deeper" / "exported"

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    command = [sys.executable, "-c", "from ctxlaunch.cli import main; main()", "export"]
    done = subprocess.run(
        [*command, str(tmp_path / "job" / "checkpoints"), "--hf", str(out)],
        preexec_fn=limit_file_size,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr and "failed reading" not in message
    assert f"{out}: writing model-00001-of-00001.safetensors failed" in message
    assert "File too large" in message
    assert not (tmp_path / "new").exists()
