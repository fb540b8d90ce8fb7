"""Where jobs run. A backend turns a spec into a dry run (the exact command and bytes it would
submit) and schedules a dry run; `submit` is literally `schedule(dryrun(spec))`.

The registry lives here, not in base.py, so the base never imports its own subclasses; each
backend's module loads only when its target is used (the Kubernetes one pulls in the client)."""

from __future__ import annotations

from importlib import import_module

from ctxlaunch.launch.backends.base import (
    Backend,
    BackendOptions,
    DryRun,
    KubernetesOptions,
    OptionsError,
    combine_exit_codes,
)

BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("local", "LocalBackend"),
    "slurm": ("slurm", "SlurmBackend"),
    "kubernetes": ("kubernetes", "KubernetesBackend"),
}
"""cluster.target -> (module in this package, class)."""


def get_backend(target: str, options: BackendOptions | None = None) -> Backend:
    """The backend of `target`, with its options; NotImplementedError for an unknown target,
    OptionsError for options of another backend."""
    try:
        module, name = BACKENDS[target]
    except KeyError:
        raise NotImplementedError(
            f"cluster.target {target!r}: no backend submits to {target}; "
            f"use one of {', '.join(BACKENDS)}"
        ) from None
    cls: type[Backend] = getattr(import_module(f".{module}", __name__), name)
    return cls() if options is None else cls.with_options(options)


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendOptions",
    "DryRun",
    "KubernetesOptions",
    "OptionsError",
    "combine_exit_codes",
    "get_backend",
]
