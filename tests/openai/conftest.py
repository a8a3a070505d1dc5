"""Fixtures for the OpenAI-compatible API tests: a worker with two API keys per test module (each module
starts its own, in a folder named after the module) and an official ``openai`` client of it as tenant A.

``worker`` here stands in for the session-wide keyless worker of tests/conftest.py in this folder."""

from __future__ import annotations

import openai
import pytest
from openai_support import KEY_A, openai_url, start_worker


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory, request):
    proc = start_worker(tiny_model_dir, tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(worker):
    with openai.OpenAI(base_url=openai_url(worker), api_key=KEY_A, max_retries=0, timeout=120) as c:
        yield c
