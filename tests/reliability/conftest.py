"""Fixtures for the reliability tests: workers with special settings, fast client retries, helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytrio_compat import config

from .reliability_helpers import KEY_A, KEY_B


@pytest.fixture()
def fast_retries(monkeypatch):
    """Short client retry windows for this test only (ServiceClient snapshots the config when created)."""
    for name, value in {"retry_initial_delay_seconds": 0.05, "retry_max_delay_seconds": 0.3,
                        "training_retry_timeout_seconds": 30, "sampling_retry_timeout_seconds": 30,
                        "control_retry_timeout_seconds": 30, "actor_event_polling_timeout_seconds": 5}.items():
        monkeypatch.setattr(config._CONFIG, name, value)


@pytest.fixture()
def client_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTRIO_COMPAT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory) -> Path:
    """The folder the special worker allows local PEFT adapters from."""
    return tmp_path_factory.mktemp("allowed-adapters")


@pytest.fixture(scope="session")
def special_worker(worker_factory, adapter_root):
    """A worker with fault injection on, two API keys (two tenants) and one allowed adapter folder."""
    return worker_factory("--allow-adapter-dir", str(adapter_root), api_keys=[KEY_A, KEY_B],
                          env={"PYTRIO_WORKER_FAULT_INJECTION": "1"})
