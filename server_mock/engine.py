"""Requests and their execution: every request gets an id at once; the torch work for one base model
runs on that model's own thread, in arrival order, so the HTTP loop never blocks on torch.

Results are kept for ``result_ttl`` seconds after they finish (long-polled by clients), then dropped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from pytrio_compat.wire import ErrorBody, RequestStatus

from .errors import WorkerError

logger = logging.getLogger("server_mock")


@dataclass
class Job:
    request_id: str
    kind: str
    fn: Callable[[], dict]
    owner: str = ""
    status: str = "queued"
    result: dict | None = None
    error: ErrorBody | None = None
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    done: asyncio.Event | None = None

    def to_status(self, queue_position: int | None = None) -> RequestStatus:
        return RequestStatus(request_id=self.request_id, status=self.status, result=self.result, error=self.error,
                             queue_position=queue_position)


class ModelQueue:
    """A FIFO of jobs for one base model, drained by one thread."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.loop = loop
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"model-{name}", daemon=True)
        self._thread.start()

    def put(self, job: Job) -> None:
        with self._lock:
            self._waiting.append(job.request_id)
        self._queue.put(job)

    def position(self, request_id: str) -> int | None:
        with self._lock:
            try:
                return self._waiting.index(request_id)
            except ValueError:
                return None

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._waiting.remove(job.request_id)
            job.status = "running"
            job.started = time.monotonic()
            try:
                job.result = job.fn()
                job.status = "succeeded"
            except WorkerError as exc:
                job.error = ErrorBody(code=exc.code, message=exc.message, field=exc.field)
                job.status = "failed"
            except torch.OutOfMemoryError as exc:
                job.error = ErrorBody(code="out_of_memory", message=f"out of memory while running {job.kind}: {exc}"
                                      " (reduce the batch or sequence length)")
                job.status = "failed"
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - the error goes back to this request only
                logger.error("request %s (%s) failed:\n%s", job.request_id, job.kind, traceback.format_exc())
                job.error = ErrorBody(code="internal_error", message=f"{job.kind} failed: {type(exc).__name__}: {exc}")
                job.status = "failed"
            job.finished = time.monotonic()
            job.fn = _done  # drop references to request tensors
            if job.done is not None:
                self.loop.call_soon_threadsafe(job.done.set)


def _done() -> dict:
    return {}


class RequestStore:
    def __init__(self, result_ttl: float = 3600.0) -> None:
        self.result_ttl = result_ttl
        self._jobs: dict[str, Job] = {}
        self._queues: dict[str, str] = {}

    def new_job(self, kind: str, fn: Callable[[], dict], owner: str = "") -> Job:
        job = Job(request_id=f"req-{uuid.uuid4().hex}", kind=kind, fn=fn, owner=owner, done=asyncio.Event())
        self._jobs[job.request_id] = job
        return job

    def get(self, request_id: str, owner: str | None = None) -> Job | None:
        job = self._jobs.get(request_id)
        if job is None or (owner is not None and job.owner != owner):
            return None
        return job

    def sweep(self) -> int:
        now = time.monotonic()
        stale = [rid for rid, job in self._jobs.items() if job.finished and now - job.finished > self.result_ttl]
        for rid in stale:
            del self._jobs[rid]
        return len(stale)

    async def wait(self, job: Job, timeout: float) -> None:
        if job.status in ("succeeded", "failed") or job.done is None:
            return
        try:
            await asyncio.wait_for(job.done.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


