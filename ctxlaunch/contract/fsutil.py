"""Files are written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path


def umasked(mode: int) -> int:
    """`mode` as the process's umask leaves it (what open() would give a new file): 0o644
    is 0o600 under umask 077. A rendered file may carry a job's environment."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def atomic_write_text(path: str | Path, text: str, mode: int = 0o644) -> Path:
    """Write `text` to `path` through a temporary file in the same directory and a rename, so
    a reader (or a crash) never sees a partial file. Creates missing parent directories. The
    file gets `mode` less the umask."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = 0o644) -> Path:
    """`atomic_write_text` for bytes (images)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, umasked(mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class WriteFailed(OSError):
    """A set of files could not be written; nothing of it was left behind."""


def missing_directories(directory: Path) -> list[Path]:
    """`directory` and those of its parents that do not exist yet, outermost first."""
    missing: list[Path] = []
    for candidate in (directory, *directory.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing.append(candidate)
    return missing[::-1]


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block (as SIGINT does), so the cleanup of a
    write in progress runs; in the main thread only (signals are handled there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_files_whole(files: dict[Path, tuple[bytes, int]]) -> list[Path]:
    """Write every file (path -> (bytes, mode)), each atomically: on any failure or interrupt
    (SIGINT, SIGTERM) the new files written so far and the directories made for them are
    removed, and WriteFailed names the path and the reason. (A file that existed before and
    was already replaced holds the new text whole: the old one cannot come back.)"""
    made: list[Path] = []
    written: list[Path] = []
    created: list[Path] = []
    with sigterm_interrupts():
        try:
            for path, (data, mode) in files.items():
                for directory in missing_directories(path.parent):
                    made.append(directory)
                    directory.mkdir()
                existed = path.exists()
                written.append(atomic_write_bytes(path, data, mode))
                if not existed:
                    created.append(path)
        except BaseException as exc:
            for new in created:
                new.unlink(missing_ok=True)
            for directory in reversed(made):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            if isinstance(exc, OSError):
                where = exc.filename or path
                raise WriteFailed(f"cannot write {where}: {exc.strerror or exc}") from None
            raise
    return written
