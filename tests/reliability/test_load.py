"""The load test (benchmarks/load_test.py) at a modest size: 8 concurrent clients, each on its own adapter,
no errors, and every adapter bit-identical to a solo replay of the same calls."""

from __future__ import annotations

import sys

import pytest
from support import REPO


@pytest.mark.slow
def test_eight_concurrent_clients_without_errors_or_crosstalk():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import load_test
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    report = load_test.run(clients=8, iterations=2, timeout=1200)
    load_test.print_report(report)
    assert report["errors"] == [] and report["crosstalk"] == [], report
    assert report["ok"] and report["compared_saved_state_files"]
    assert all(report["client_latency"][call]["count"] == 16 for call in load_test.CALLS)
    assert {"sample", "forward_backward", "optim_step"} <= set(report["worker_queue"])
