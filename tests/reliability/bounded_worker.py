"""An in-process worker with limits of the test's choosing, two API keys and the connection guard of
``pytrio-worker serve`` (real uvicorn on a free loopback port), for tests of bounds that need every protocol."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn
from starlette.applications import Starlette

from server_mock.app import create_app
from server_mock.config import Connections, Limits, PytrioOptions, StorageOptions
from server_mock.connections import ConnectionGuard, guarded_protocol
from server_mock.service.worker import WorkerService

from .reliability_helpers import KEY_A, KEY_B


@dataclass
class Bounded:
    url: str
    service: WorkerService
    app: Starlette
    guard: ConnectionGuard


@contextmanager
def bounded_worker(model_dir: Path, storage: Path, limits: Limits, connections: Connections | None = None,
                   storage_options: StorageOptions | None = None,
                   pytrio_options: PytrioOptions | None = None) -> Iterator[Bounded]:
    service = WorkerService({"tiny": str(model_dir)}, storage, "cpu", torch.float32, limits=limits,
                            storage_options=storage_options)
    app = create_app(service, [KEY_A, KEY_B], pytrio_options=pytrio_options)
    guard = ConnectionGuard(connections or Connections())
    guard.relieve = app.state.long_polls.relieve  # as pytrio-worker serve does
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=guarded_protocol(guard)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield Bounded(f"http://127.0.0.1:{sock.getsockname()[1]}", service, app, guard)
    finally:
        server.should_exit = True
        thread.join(15)
