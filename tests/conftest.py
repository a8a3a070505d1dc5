"""Shared fixtures: one tiny random model on disk and one real worker serving it over HTTP."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Property tests draw the same examples on every run so a test run is repeatable; set
# HYPOTHESIS_PROFILE=explore to draw fresh ones (and keep any input it finds as a regression test).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from server_mock.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def worker(tiny_model_dir, tmp_path_factory):
    from support import running_worker

    with running_worker(tiny_model_dir, tmp_path_factory.mktemp("worker")) as proc:
        yield proc


@pytest.fixture()
def service(worker, tmp_path, monkeypatch):
    from support import sdk_service

    with sdk_service(worker.base_url, tmp_path / "cache", monkeypatch) as client:
        yield client
