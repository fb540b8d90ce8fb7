"""The fixture the node test modules share: the project image, built (or taken from the
cache) and imported into the node's containerd, once per module; skips where the node is not
running."""

from __future__ import annotations

import pytest

from devkit.kube_node import project_image
from tests.helpers.kube_node import require_node


@pytest.fixture(scope="module")
def image() -> str:
    require_node()
    return project_image()
