"""What the tests and the benchmarks both use, outside the package and never installed: the
instruments that measure the trainer (memtrace: what autograd saves and the allocator's peak;
launches: the kernel launches and bytes a schedule would make), the synthetic document lengths
of the CP balance checks (doc_lengths), and the stand-ins and commands for the single-node
Kubernetes cluster the services run (pytorchjob_operator, kube_node).

tests/ and benchmarks/ import from here; this package imports neither of them, and neither
imports the other (tests/unit/test_layers.py holds the rule)."""

from __future__ import annotations

import os
from pathlib import Path

SERVICES_DIR = Path(os.environ.get("CTXLAUNCH_SERVICES_DIR", "/var/tmp/ctxlaunch-services"))
"""Where scripts/services keep the services' state (CTXLAUNCH_SERVICES_DIR)."""
