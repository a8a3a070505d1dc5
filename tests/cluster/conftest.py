"""A local Ray cluster per test module (a few logical CPUs, shut down after the module) and an SDK client of
the worker on it. Each test module starts its own worker on the cluster (its ``ray_worker`` fixture)."""

from __future__ import annotations

import pytest
from support import sdk_service

try:
    import ray
except ImportError:  # the cluster extra is not installed: the tests that need a cluster skip
    ray = None

from .ray_helpers import NAMESPACE


@pytest.fixture(scope="module")
def ray_address():
    if ray is None:
        pytest.skip("the cluster extra (pip install -e .[cluster]) is not installed")
    ray.init(num_cpus=8, include_dashboard=False, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture()
def ray_service(ray_worker, tmp_path, monkeypatch):
    """A ServiceClient of the requesting module's ``ray_worker``, as the top-level ``service`` fixture."""
    with sdk_service(ray_worker.base_url, tmp_path / "cache", monkeypatch) as client:
        yield client
