"""Helpers for the streaming tests: an in-process worker (real uvicorn on a loopback port, so the official client
speaks real HTTP to it, with the service at hand) and a gate that holds the decode loop before each step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from support import serve_app

from server_mock.app import create_app
from server_mock.config import Limits
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.service.worker import WorkerService

KEY = "key-streaming"


@dataclass
class Running:
    url: str
    service: WorkerService


@contextmanager
def in_process_worker(model_dir: Path, storage: Path, limits: Limits | None = None) -> Iterator[Running]:
    service = WorkerService({"tiny": str(model_dir)}, storage, "cpu", torch.float32, limits=limits,
                            storage_options=None)
    with serve_app(create_app(service, [KEY])) as url:
        yield Running(f"{url}/api/openai/v1", service)


def wait_until(condition: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Wait for another thread to make ``condition`` true (a liveness bound, not a timing check)."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


class StepGate:
    """Once ``hold`` is called, holds every ``DecodeBatch`` before each decode step until the test lets one run
    (``let``), counting the steps run and recording the rows decoding at the start of each (``rows``)."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch
        self.permits = threading.Semaphore(0)
        self.ran = 0  # steps run so far
        self.rows: list[int] = []  # live rows as each step began (before it ended cancelled ones)
        self.opened = False
        self.stuck = False  # a step waited past the liveness bound: the test failed to let it run

    def hold(self) -> None:
        original = DecodeBatch._step
        gate = self

        def step(batch):
            gate.rows.append(batch.live_rows)
            if not gate.opened and not gate.permits.acquire(timeout=60):
                gate.stuck, gate.opened = True, True
            gate.ran += 1
            return original(batch)

        self.monkeypatch.setattr(DecodeBatch, "_step", step)

    def let(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def open(self) -> None:
        self.opened = True
        self.permits.release(1000)
