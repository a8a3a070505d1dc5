"""Helpers shared by the reliability tests."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import torch

import pytrio_compat as trio
from support import serve_app

from server_mock.app import create_app
from server_mock.service.worker import WorkerService

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"


def datum(offset: int = 0, n: int = 20) -> trio.Datum:
    ids = [(7 * i + offset) % 480 + 10 for i in range(n)]
    return trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def saved_state(storage: Path, tc) -> dict[str, bytes]:
    """Weights and Adam state of a run, as saved on disk, for bit-exact comparison."""
    from server_mock.storage.checkpoints import CheckpointStore, parse_path

    path = tc.save_state(f"fingerprint-{tc._next_seq}").result().path
    return CheckpointStore(storage).fingerprint(parse_path(path))


def datum_wire(offset: int = 0, n: int = 20) -> dict:
    """The same datum in the worker's wire format, for raw HTTP requests."""
    from pytrio_compat.types.tensor import WireTensor

    ids = np.asarray([(7 * i + offset) % 480 + 10 for i in range(n)], dtype=np.int64)
    return {"tokens": WireTensor.from_array(ids[:-1]).model_dump(),
            "loss_fn_inputs": {"target_tokens": WireTensor.from_array(ids[1:]).model_dump()}}


def on_event_loop() -> bool:
    """Whether the caller runs on an asyncio event loop (in the in-process worker: the loop that answers clients)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@contextmanager
def in_process_worker(model_dir: Path, storage: Path) -> Iterator[str]:
    """A worker in this process (real uvicorn on a free loopback port, real HTTP; the tiny model on the CPU in
    float32), so that a test can watch or hold what it does; yields its base URL, shut down after the block.
    Patches meant to be seen by the worker go in before entering."""
    with serving(WorkerService({"tiny": str(model_dir)}, storage, "cpu", torch.float32)) as url:
        yield url


@contextmanager
def serving(service: WorkerService, api_keys: list[str] | None = None) -> Iterator[str]:
    """``service`` behind a real uvicorn on a free loopback port in this process; yields its base URL."""
    with serve_app(create_app(service, api_keys)) as url:
        yield url


def resident_bytes(pid: int) -> int:
    """A process's resident memory (Linux /proc), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Watch:
    """While a block runs: a worker's resident memory, sampled every 5 ms (``peak_growth`` over the start), and
    the latency of another tenant's ``/v1/health``, asked every 20 ms (``health_max``)."""

    def __init__(self, pid: int, health_url: str, key: str | None = None) -> None:
        self.pid, self.health_url = pid, health_url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.peak_growth = 0
        self.health: list[float] = []

    def __enter__(self) -> "Watch":
        self._stop = threading.Event()
        self.start = resident_bytes(self.pid)
        self._threads = [threading.Thread(target=self._memory, daemon=True),
                         threading.Thread(target=self._ping, daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _memory(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_growth = max(self.peak_growth, resident_bytes(self.pid) - self.start)
            except OSError:
                return
            time.sleep(0.005)

    def _ping(self) -> None:
        with httpx.Client(timeout=30, headers=self.headers) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    http.get(self.health_url)
                    self.health.append(time.perf_counter() - started)
                except httpx.HTTPError:
                    self.health.append(float("inf"))
                time.sleep(0.02)

    @property
    def health_max(self) -> float:
        return max(self.health, default=0.0)
