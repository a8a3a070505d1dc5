"""An in-process worker for the operator's tests: real uvicorn on a free loopback port (so that the SDKs speak real
HTTP to it), with API keys, admin keys and limits of the test's choosing; the service is at hand to read or drive
(its token budgets' clock, its metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from support import FakeClock, serve_app  # noqa: F401  (FakeClock: the operator tests take it from here)

from server_mock.app import create_app
from server_mock.config import Limits
from server_mock.service.worker import WorkerService

TENANT_KEY = "tenant-key-one"
OTHER_KEY = "tenant-key-two"
ADMIN_KEY = "operator-key-0123"
ADMIN = {"x-admin-key": ADMIN_KEY}


@dataclass
class Running:
    url: str
    service: WorkerService


@contextmanager
def operator_worker(model_dir: Path, storage: Path, *, keys=(TENANT_KEY, OTHER_KEY), admin_keys=(ADMIN_KEY,),
                    limits: Limits | None = None, model_name: str = "tiny") -> Iterator[Running]:
    service = WorkerService({model_name: str(model_dir)}, storage, "cpu", torch.float32, limits=limits,
                            storage_options=None)
    with serve_app(create_app(service, list(keys), admin_keys=list(admin_keys))) as url:
        yield Running(url, service)
