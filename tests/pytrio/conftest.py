"""Fixtures for the PyTRIO protocol tests (helpers in pytrio_support.py)."""

from __future__ import annotations

import pytest
from pytrio_support import KEY_A, KEY_B


@pytest.fixture(scope="module")
def pytrio_worker(worker_factory):
    """A worker with two API keys (two tenants), serving the tiny model as ``tiny``; its model_id (the tokenizer
    the SDK loads) is then the model's absolute folder. In this process: the SDK runs in processes of its own."""
    return worker_factory(api_keys=[KEY_A, KEY_B])
