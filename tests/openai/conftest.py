"""Fixtures for the OpenAI-compatible API tests: the session's worker with two API keys (``worker_factory``,
shared by the modules here) and an official ``openai`` client of it as tenant A.

``worker`` here stands in for the session-wide keyless worker of tests/conftest.py in this folder."""

from __future__ import annotations

import openai
import pytest
from openai_support import KEY_A, KEY_B, openai_url


@pytest.fixture(scope="module")
def worker(worker_factory):
    return worker_factory(api_keys=[KEY_A, KEY_B])


@pytest.fixture(scope="module")
def client(worker):
    with openai.OpenAI(base_url=openai_url(worker), api_key=KEY_A, max_retries=0, timeout=120) as c:
        yield c
