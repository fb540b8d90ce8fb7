"""Where jobs run. A backend turns a spec into a dry run (the exact command and bytes it would
submit) and schedules a dry run; `submit` is literally `schedule(dryrun(spec))`.

The registry lives here, not in base.py, so the base never imports its own subclasses; each
backend's module loads only when its target is used (the Kubernetes one pulls in the client)."""

from __future__ import annotations

from importlib import import_module

from ctxlaunch.launch.backends.base import Backend, DryRun, combine_exit_codes

BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("local", "LocalBackend"),
    "slurm": ("slurm", "SlurmBackend"),
    "kubernetes": ("kubernetes", "KubernetesBackend"),
}
"""cluster.target -> (module in this package, class)."""


def get_backend(target: str) -> Backend:
    try:
        module, cls = BACKENDS[target]
    except KeyError:
        raise NotImplementedError(f"cluster.target {target!r}: no backend submits to {target}; "
                                  f"use one of {', '.join(BACKENDS)}") from None
    return getattr(import_module(f".{module}", __name__), cls)()


__all__ = ["BACKENDS", "Backend", "DryRun", "combine_exit_codes", "get_backend"]
