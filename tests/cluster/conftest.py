"""A local Ray cluster per test module (a few logical CPUs, shut down after the module) and a worker on it."""

from __future__ import annotations


import pytest

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
