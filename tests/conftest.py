"""Shared fixtures: one tiny random model on disk and its tokenizer, the session's workers (one per set of flags,
``worker_factory``), and the keyless worker serving the tiny model over HTTP (``worker``)."""

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

# Tests that need an optional install (the Ray cluster, the official clients) skip without it. Where every extra
# is installed (scripts/test.sh, hence CI), a missing one must fail the run instead of shrinking it silently.
REQUIRED_WITH_EXTRAS = ("ray", "tinker", "openai", "grpc_tools", "pytrio", "trio_cookbook", "tinker_cookbook")


def pytest_sessionstart(session):
    if os.environ.get("PYTRIO_REQUIRE_EXTRAS") == "1":
        import importlib.util

        missing = [name for name in REQUIRED_WITH_EXTRAS if importlib.util.find_spec(name) is None]
        if missing:
            raise pytest.UsageError(f"PYTRIO_REQUIRE_EXTRAS=1 but {', '.join(missing)} is not installed: "
                                    "run bash scripts/setup_env.sh (it installs every extra)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from server_mock.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tiny models' tokenizer (``build_tiny_tokenizer``: 512 tokens, ChatML), built once per session. Shared:
    a test that changes it (its chat template, its special tokens) works on a copy."""
    from server_mock.engine.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def worker_factory(tiny_model_dir, tmp_path_factory):
    """``worker_factory(*flags, api_keys=..., process=False)``: a worker of the tiny model with those flags, shared
    by every test of the session that asks for the same ones (``support.WorkerFactory``)."""
    from support import WorkerFactory

    factory = WorkerFactory(tiny_model_dir, tmp_path_factory.mktemp("workers"))
    yield factory
    factory.close()


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
