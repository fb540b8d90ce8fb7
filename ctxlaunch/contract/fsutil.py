"""Files are written whole or not at all."""

from __future__ import annotations

import os
import tempfile
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
