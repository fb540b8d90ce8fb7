"""The layer cache of scripts/services/ociimage.py (the node tests' project image): a layer
taken from the cache counts as used now, and pruning keeps the layers used last (an
environment layer is the whole venv, about 2 GB; kept without bound they filled the disk)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tests.helpers.paths import ROOT


def _ociimage():
    spec = importlib.util.spec_from_file_location(
        "ociimage", ROOT / "scripts" / "services" / "ociimage.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(layer, text: str) -> None:
    layer.file("/hello.txt", data=text.encode())


def test_a_cached_layer_is_reused_and_the_last_used_are_kept(tmp_path: Path) -> None:
    oci = _ociimage()
    cache = tmp_path / "cache"
    made = {}
    for number, key in enumerate(("env-a", "env-b", "env-c")):
        made[key] = oci.cached_layer(cache, key, lambda layer, k=key: _write(layer, k))
        os.utime(made[key][0], (1000 + number, 1000 + number))  # written in this order
    again = oci.cached_layer(cache, "env-a", lambda layer: _write(layer, "never written"))
    assert again == made["env-a"]  # from the cache: same file, digest and size
    oci.prune(cache, "env-", keep=2)
    # env-a was used last (the cache hit), env-c written last; env-b goes.
    assert sorted(p.name for p in cache.glob("env-*.tar")) == ["env-a.tar", "env-c.tar"]
    assert not (cache / "env-b.json").exists() and not (cache / "env-b.lock").exists()
