"""promtool, Prometheus's own checker of rule files, for the tests of the alerting rules
(`promtool check rules`, and `promtool test rules` on tests/promtool/).

promtool comes with Debian's prometheus package, which `scripts/services/prometheus.sh install`
installs (scripts/test does it). The fast loop (`pytest tests/unit`) needs no service and no
root, so there a test that needs promtool skips where it is missing, saying how to get it.
Where the services are installed (SERVICES_ENV, which scripts/test exports) a missing promtool
is a failure instead: the whole suite cannot pass without having run these tests."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.services import SERVICES_ENV, services_installed

RULE_TESTS = ROOT / "tests" / "promtool" / "ctxlaunch-rules.test.yml"
"""promtool's unit tests of the committed rules (their series are all job train-8b)."""
INSTALL_HINT = (
    "run `scripts/services/prometheus.sh install` (as root; it installs Debian's prometheus, "
    "which ships promtool)"
)


def promtool() -> str:
    """The path of promtool. Where it is not installed, the test skips, or fails where the
    services are installed (SERVICES_ENV=1)."""
    path = shutil.which("promtool")
    if path is not None:
        return path
    reason = f"promtool is not installed: {INSTALL_HINT}"
    if services_installed():
        pytest.fail(
            f"{reason} ({SERVICES_ENV}=1: the services should have brought it)", pytrace=False
        )
    pytest.skip(reason)
