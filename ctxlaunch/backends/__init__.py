"""Where jobs run. A backend turns a spec into a dry run (the exact command and bytes it would
submit) and schedules a dry run; `submit` is literally `schedule(dryrun(spec))`."""

from __future__ import annotations

from .base import Backend, DryRun, combine_exit_codes, get_backend

__all__ = ["Backend", "DryRun", "combine_exit_codes", "get_backend"]
