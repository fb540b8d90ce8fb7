"""The files ctxlaunch ships beside its code: the example specs, the Grafana dashboard and the
Prometheus rules.

In a wheel they are package data under ctxlaunch/share (pyproject.toml's force-include copies
the repository's jobs/ and manifests/ there); in a checkout (an editable install, or
PYTHONPATH) they are read from the repository itself, so the two never differ. The CLI hands
them out (`ctxlaunch examples`, `dashboard`, `alerts`) and `render` builds the monitoring
objects from them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

REPOSITORY = Path(__file__).resolve().parents[2]
"""The checkout this module sits in, when it is one."""
SHIPPED: dict[str, tuple[str, str]] = {
    "jobs": ("jobs", "jobs"),
    "dashboard": ("grafana/ctxlaunch-training.json", "manifests/grafana/ctxlaunch-training.json"),
    "alerts": ("prometheus/ctxlaunch-rules.yml", "manifests/prometheus/ctxlaunch-rules.yml"),
}
"""What is shipped -> (its path under ctxlaunch/share in a wheel, its path in the repository)."""


class ShippedFileMissing(LookupError):
    """This installation has neither the packaged file nor a checkout holding it."""


def shipped(what: str) -> Traversable:
    """The packaged file or folder `what` (a key of SHIPPED), else the repository's;
    ShippedFileMissing when neither is there (a source tree copied without jobs/ and
    manifests/)."""
    packaged_path, repository_path = SHIPPED[what]
    packaged = resources.files("ctxlaunch").joinpath("share", *packaged_path.split("/"))
    if packaged.is_file() or packaged.is_dir():
        return packaged
    local = REPOSITORY / repository_path
    if local.exists():
        return local
    raise ShippedFileMissing(
        f"this ctxlaunch installation has no {packaged_path} (neither packaged nor in {local})"
    )
