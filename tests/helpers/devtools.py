"""The development-time tools under scripts/dev, imported by path (they are scripts, not part of
the installed package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DEV_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "dev"


def dev_script(name: str) -> ModuleType:
    """The module of scripts/dev/<name>.py, loaded once per process."""
    module_name = f"ctxlaunch_dev_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, DEV_SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
