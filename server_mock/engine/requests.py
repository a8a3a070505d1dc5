"""Every request by id, for polling: a finished request is forgotten ``result_ttl`` seconds later, or sooner when
its tenant's finished results together hold more than ``max_result_bytes`` (its oldest go first)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from typing import Any, Callable

from server_mock.engine.jobs import Job
from server_mock.errors import WorkerError

DROPPED_REMEMBERED = 4096  # ids of results dropped for bytes, remembered to say why they are gone


class FinishedResults:
    """The finished results of each owner (an API key), oldest first, with their bytes and when they finished: the
    one bookkeeping of every store of answers kept for polling (the service's requests, Tinker's futures). A result
    is kept ``ttl`` seconds; past ``max_bytes`` of one owner, that owner's oldest are dropped at once (the newest
    always stays, so that it can be fetched), and their ids are remembered to say why they are gone."""

    def __init__(self, ttl: float, max_bytes: int) -> None:
        self.ttl, self.max_bytes = ttl, max_bytes
        self._held: dict[str, OrderedDict[str, tuple[int, float]]] = {}  # owner -> id -> (bytes, finished)
        self._bytes: dict[str, int] = {}
        self._dropped: OrderedDict[str, str] = OrderedDict()  # id -> owner

    def add(self, owner: str, result_id: str, size: int, finished: float) -> list[str]:
        """Count a finished result; the ids of this owner's oldest dropped to stay within ``max_bytes``."""
        held = self._held.setdefault(owner, OrderedDict())
        held[result_id] = (size, finished)
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        dropped = []
        while self._bytes[owner] > self.max_bytes and len(held) > 1:
            oldest = next(iter(held))
            self.remove(owner, oldest)
            dropped.append(oldest)
            self._dropped[oldest] = owner
            while len(self._dropped) > DROPPED_REMEMBERED:
                self._dropped.popitem(last=False)
        return dropped

    def remove(self, owner: str, result_id: str) -> None:
        held = self._held.get(owner)
        if held is None or result_id not in held:
            return
        left = self._bytes.get(owner, 0) - held.pop(result_id)[0]
        if held:
            self._bytes[owner] = left
        else:
            del self._held[owner]
            self._bytes.pop(owner, None)

    def expired(self, now: float) -> list[tuple[str, str]]:
        """(owner, id) of each result finished more than ``ttl`` seconds before ``now``."""
        cutoff = now - self.ttl
        return [(owner, rid) for owner, held in self._held.items() for rid, (_, at) in held.items() if at < cutoff]

    def held_bytes(self, owner: str) -> int:
        return self._bytes.get(owner, 0)

    def dropped_for_bytes(self, result_id: str, owner: str) -> bool:
        """Whether this owner's result was dropped to stay within ``max_bytes`` (rather than expired)."""
        return self._dropped.get(result_id) == owner


class RequestStore:
    """Every request by id, for polling. A finished request is forgotten ``result_ttl`` seconds later; past
    ``max_result_bytes`` of finished results per owner, that owner's oldest are forgotten at once."""

    def __init__(self, result_ttl: float = 3600.0, max_result_bytes: int = 1 << 30) -> None:
        self.result_ttl = result_ttl
        self.max_result_bytes = max_result_bytes
        self._jobs: dict[str, Job] = {}
        self._unfinished: dict[str, Job] = {}  # queued or running; only touched on the event loop
        self._results = FinishedResults(result_ttl, max_result_bytes)  # what the finished ones hold

    def new_job(self, kind: str, fn: Callable[[], dict], owner: str = "", request_id: str | None = None) -> Job:
        """A job for a new request (``request_id``: one accepted before a restart, queued again under its id)."""
        job = Job(request_id=request_id or f"req-{uuid.uuid4().hex}", kind=kind, fn=fn, owner=owner,
                  done=asyncio.Event())
        job.on_finish = self._finished
        self._jobs[job.request_id] = job
        self._unfinished[job.request_id] = job
        return job

    def restore(self, request_id: str, owner: str, kind: str, result: dict | None, error: WorkerError | None,
                finished_ago: float) -> None:
        """A request that finished before a restart (``finished_ago`` seconds ago), answered to polls again."""
        now = time.monotonic()
        job = Job(request_id=request_id, kind=kind, fn=lambda: {}, owner=owner, done=asyncio.Event(),
                  status="failed" if error is not None else "succeeded", result=result, error=error,
                  created=now - finished_ago, started=now - finished_ago, finished=now - max(0.0, finished_ago))
        job.done.set()
        self._jobs[request_id] = job
        self._finished(job)

    def get(self, request_id: str, owner: str | None = None) -> Job | None:
        job = self._jobs.get(request_id)
        if job is None or (owner is not None and job.owner != owner):
            return None
        if self._expired(job, time.monotonic()):
            self._forget(request_id)
            return None
        return job

    def discard(self, request_id: str) -> None:
        """Forget a request that was never accepted (its acceptance could not be recorded)."""
        self._unfinished.pop(request_id, None)
        self._jobs.pop(request_id, None)

    def why_gone(self, request_id: str, owner: str) -> str:
        """Why an unknown request of ``owner`` may be unknown, for the 404."""
        if self._results.dropped_for_bytes(request_id, owner):
            return (f"dropped: this API key's finished results held more than max_result_bytes="
                    f"{self.max_result_bytes} bytes, and the oldest go first")
        return "expired or worker restarted"

    def unfinished(self, owner: str) -> int:
        """How many of this owner's requests are queued or running."""
        for rid in [rid for rid, job in self._unfinished.items() if job.finished is not None]:
            del self._unfinished[rid]
        return sum(1 for job in self._unfinished.values() if job.owner == owner)

    def held_bytes(self, owner: str) -> int:
        """What this owner's finished results hold, as counted against ``max_result_bytes``."""
        return self._results.held_bytes(owner)

    def _expired(self, job: Job, now: float) -> bool:
        return job.finished is not None and now - job.finished > self.result_ttl

    def _finished(self, job: Job) -> None:
        """On the event loop, when a job finishes: count its result, and drop the owner's oldest results while
        they hold more than the budget (the newest always stays, so that it can be fetched)."""
        if job.request_id not in self._jobs:
            return
        for oldest in self._results.add(job.owner, job.request_id, approx_bytes(job.result), job.finished or 0.0):
            self._jobs.pop(oldest, None)

    def _forget(self, request_id: str) -> None:
        job = self._jobs.pop(request_id, None)
        if job is not None:
            self._results.remove(job.owner, request_id)

    def sweep(self) -> int:
        now = time.monotonic()
        stale = [rid for rid, job in self._jobs.items() if self._expired(job, now)]
        for rid in stale:
            self._forget(rid)
        return len(stale)

    async def wait(self, job: Job, timeout: float) -> None:
        if job.status in ("succeeded", "failed") or job.done is None:
            return
        try:
            await asyncio.wait_for(job.done.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def approx_bytes(value: Any) -> int:
    """About what a result holds, cheaply: bytes and strings by length, a list of numbers 8 bytes an item (from its
    first item; results are uniform), containers by their contents."""
    if value is None or isinstance(value, (bool, int, float)):
        return 8
    if isinstance(value, (bytes, bytearray, str)):
        return len(value) + 32
    if isinstance(value, dict):
        return 64 + sum(approx_bytes(k) + approx_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        if not value:
            return 56
        first = value[0]
        if first is None or isinstance(first, (bool, int, float)):
            return 56 + 8 * len(value)
        if len(value) > 32:  # a long list of containers (top-k rows): measured on 16 of its items
            step = len(value) // 16
            return 56 + sum(approx_bytes(value[i * step]) for i in range(16)) * len(value) // 16
        return 56 + sum(approx_bytes(item) for item in value)
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) + 96 if isinstance(nbytes, int) else 64


def run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"
