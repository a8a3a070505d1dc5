"""Fixtures for the PyTRIO protocol tests (helpers in pytrio_support.py)."""

from __future__ import annotations

import pytest
from pytrio_support import KEY_A, KEY_B


@pytest.fixture(scope="module")
def pytrio_worker(tiny_model_dir, tmp_path_factory):
    """A worker with two API keys (two tenants), serving the tiny model as ``tiny``; its model_id (the tokenizer
    the SDK loads) is then the model's absolute folder."""
    from support import WorkerProcess

    root = tmp_path_factory.mktemp("pytrio-worker")
    proc = WorkerProcess(tiny_model_dir, root / "storage", api_keys=[KEY_A, KEY_B]).start()
    yield proc
    proc.stop()
