"""An in-process worker with two tenants (API keys A and B) on a storage folder a test chooses, restartable on it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
import uvicorn

from server_mock.app import create_app
from server_mock.service.worker import WorkerService

from .reliability_helpers import KEY_A, KEY_B


@contextmanager
def worker(model_dir: Path, storage: Path, **options) -> Iterator[tuple[str, object]]:
    """A worker in this process (real uvicorn, real HTTP) serving the tiny model as ``tiny``; yields (base URL, app),
    shut down (its journal closed) after the block. ``options``: WorkerService's (``limits=``, ...)."""
    service = WorkerService({"tiny": str(model_dir)}, storage, "cpu", torch.float32, **options)
    app = create_app(service, [KEY_A, KEY_B])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    assert server.started, "the worker did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(15)


def client(base: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=60, headers={"X-API-Key": key})


def native_run(http: httpx.Client) -> str:
    response = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}})
    assert response.status_code == 200, response.text
    return response.json()["training_run_id"]
