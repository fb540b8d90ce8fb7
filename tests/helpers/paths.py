"""Where the tests find the repository's files."""

from __future__ import annotations

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""
JOBS = ROOT / "jobs"
"""The example job specs."""
GOLDEN = ROOT / "tests" / "golden"
"""The golden files: every rendered artifact and report, as committed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TEXT_CORPUS = ROOT / "docs" / "guides" / "continued-pretraining.md"
"""A page of English technical prose that names a special token (`<|end_of_text|>`) in its
text: the corpus of the tokenizer and byte-level data tests."""
