"""An in-process worker with limits of the test's choosing, two API keys and the connection guard of
``pytrio-worker serve`` (real uvicorn on a free loopback port), for tests of bounds that need every protocol."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from starlette.applications import Starlette

from support import serve_app

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
    with serve_app(app, http=guarded_protocol(guard)) as url:
        yield Bounded(url, service, app, guard)
