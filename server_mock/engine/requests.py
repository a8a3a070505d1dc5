"""Every request by id, for polling: a finished request is forgotten ``result_ttl`` seconds later."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Callable

from server_mock.engine.queue import Job


class RequestStore:
    """Every request by id, for polling. A finished request is forgotten ``result_ttl`` seconds later."""

    def __init__(self, result_ttl: float = 3600.0) -> None:
        self.result_ttl = result_ttl
        self._jobs: dict[str, Job] = {}
        self._unfinished: dict[str, Job] = {}  # queued or running; only touched on the event loop

    def new_job(self, kind: str, fn: Callable[[], dict], owner: str = "") -> Job:
        job = Job(request_id=f"req-{uuid.uuid4().hex}", kind=kind, fn=fn, owner=owner, done=asyncio.Event())
        self._jobs[job.request_id] = job
        self._unfinished[job.request_id] = job
        return job

    def get(self, request_id: str, owner: str | None = None) -> Job | None:
        job = self._jobs.get(request_id)
        if job is None or (owner is not None and job.owner != owner):
            return None
        if self._expired(job, time.monotonic()):
            del self._jobs[request_id]
            return None
        return job

    def unfinished(self, owner: str) -> int:
        """How many of this owner's requests are queued or running."""
        for rid in [rid for rid, job in self._unfinished.items() if job.finished is not None]:
            del self._unfinished[rid]
        return sum(1 for job in self._unfinished.values() if job.owner == owner)

    def _expired(self, job: Job, now: float) -> bool:
        return job.finished is not None and now - job.finished > self.result_ttl

    def sweep(self) -> int:
        now = time.monotonic()
        stale = [rid for rid, job in self._jobs.items() if self._expired(job, now)]
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


