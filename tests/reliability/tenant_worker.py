"""An in-process worker with two tenants (API keys A and B) on a storage folder a test chooses, restartable on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from support import serve_app

from server_mock.app import create_app
from server_mock.service.worker import WorkerService

from .reliability_helpers import KEY_A, KEY_B


@contextmanager
def worker(model_dir: Path, storage: Path, **options) -> Iterator[tuple[str, object]]:
    """A worker in this process (real uvicorn, real HTTP) serving the tiny model as ``tiny``; yields (base URL, app),
    shut down (its journal closed) after the block. ``options``: WorkerService's (``limits=``, ...)."""
    service = WorkerService({"tiny": str(model_dir)}, storage, "cpu", torch.float32, **options)
    app = create_app(service, [KEY_A, KEY_B])
    with serve_app(app) as url:
        yield url, app


def client(base: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=60, headers={"X-API-Key": key})


def native_run(http: httpx.Client) -> str:
    response = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}})
    assert response.status_code == 200, response.text
    return response.json()["training_run_id"]
