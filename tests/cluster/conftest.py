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
    # Ray starts its worker processes (the worker's sampler and trainer actors) at niceness 15 unless told
    # otherwise: beside the other test processes (niceness 0) the actors got almost no CPU, and the Ray file's first
    # training call took 88-132 s instead of 15 s. This cluster's actors run at the test processes' priority.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_worker_niceness", "0")
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
