"""A local Ray cluster per test module (a few logical CPUs, shut down after the module) and a worker on it."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="the cluster extra (pip install -e .[cluster]) is not installed")

from .ray_helpers import NAMESPACE


@pytest.fixture(scope="module")
def ray_address():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=8, include_dashboard=False, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
