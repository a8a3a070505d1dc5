"""Tinker futures and per-model sequencing.

Every Tinker operation answers at once with ``{"request_id"}``; the client then long-polls
``retrieve_future``. A future here is an asyncio task that yields the final answer: a dict (sent as
JSON) or bytes (sent as protobuf), or raises ``TinkerFailure`` (sent as ``{"error", "category"}``).

``SeqGate`` puts one training model's requests in ``seq_id`` order before they reach the service.
The client numbers them 1, 2, ... and sends a batch's chunks in parallel, the first chunk last and only
after the others have been answered: so a request that arrives early gets its future at once and is
handed to the service when its predecessors have been. A re-sent ``seq_id`` gets the original future.
Every admitted ``seq_id`` yields a future, a failed one if the request was invalid, so a rejected
request never stalls the requests behind it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .engine import Job
from .errors import WorkerError

logger = logging.getLogger("server_mock")

SERVER_ERROR_CODES = {"internal_error", "out_of_memory"}


class TinkerFailure(Exception):
    """An operation that failed; ``category`` is Tinker's "user" or "server"."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.message = message
        self.category = category

    @classmethod
    def from_worker_error(cls, exc: WorkerError) -> TinkerFailure:
        server = exc.status >= 500 or exc.code in SERVER_ERROR_CODES
        return cls(exc.message, "server" if server else "user")


@dataclass
class Future:
    request_id: str
    tenant: str
    task: asyncio.Task


class Futures:
    """request_id -> Future. The oldest are forgotten past ``max_entries``."""

    def __init__(self, max_entries: int = 20_000) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[str, Future] = OrderedDict()

    @staticmethod
    def new_id() -> str:
        return f"tk-{uuid.uuid4().hex}"

    def add(self, tenant: str, work: Awaitable[Any], request_id: str | None = None) -> str:
        request_id = request_id or self.new_id()
        task = asyncio.ensure_future(work)
        task.add_done_callback(_consume_exception)
        self._items[request_id] = Future(request_id, tenant, task)
        while len(self._items) > self.max_entries:
            _, old = self._items.popitem(last=False)
            if not old.task.done():
                old.task.cancel()
        return request_id

    def add_failed(self, tenant: str, failure: TinkerFailure | WorkerError) -> str:
        if isinstance(failure, WorkerError):
            failure = TinkerFailure.from_worker_error(failure)

        async def fail() -> Any:
            raise failure

        return self.add(tenant, fail())

    def get(self, request_id: str, tenant: str) -> Future | None:
        future = self._items.get(request_id)
        if future is None or future.tenant != tenant:
            return None
        return future


def _consume_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved; the poller reads it again from the task


async def job_result(job: Job, convert: Callable[[dict], Any] | None = None) -> Any:
    """Wait for a service job; its result through ``convert`` (which may be async), or its WorkerError."""
    if job.done is not None:
        await job.done.wait()
    if job.status == "failed":
        err = job.error
        if err is None:
            raise WorkerError(500, "internal_error", f"{job.kind} failed")
        raise WorkerError(500 if err.code in SERVER_ERROR_CODES else 400, err.code, err.message, err.field)
    result = job.result or {}
    if convert is None:
        return result
    out = convert(result)
    if asyncio.iscoroutine(out):
        out = await out
    return out


@dataclass
class _Waiting:
    request_id: str
    digest: str
    submit: Callable[[], Awaitable[Any]]
    slot: asyncio.Future


async def _when_submitted(slot: asyncio.Future) -> Any:
    work = await slot
    return await work


class SeqGate:
    """Hands one model's requests to the service strictly in seq_id order (see the module docstring).

    ``submit()`` hands a request to the service and returns the awaitable of its result (an invalid
    request's awaitable raises). It may raise a 429 WorkerError instead, when the service's queue is
    full: an in-order request is then turned away with that error (the client re-sends it), and a held
    one is retried shortly, holding up its successors.
    """

    def __init__(self, first: int = 1, gap_wait: float = 60.0, max_waiting: int = 256, keep: int = 4096,
                 retry_after: float = 0.5) -> None:
        self.next = first
        self.gap_wait = gap_wait
        self.max_waiting = max_waiting
        self.keep = keep
        self.retry_after = retry_after
        self._admitted: OrderedDict[int, tuple[str | None, str]] = OrderedDict()  # seq -> (request id, digest)
        self._waiting: dict[int, _Waiting] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._progress_at = 0.0

    def admit(self, seq: int, digest: str, submit: Callable[[], Awaitable[Any]],
              add_future: Callable[[Awaitable[Any]], str], fail: Callable[[str], str]) -> str:
        """The request id of ``seq``: a new future, or the original one for a re-send.

        ``add_future(awaitable)`` registers a future and returns its id; ``fail(message)`` registers a
        failed one, for a request that cannot be admitted at all.
        """
        seen = self._admitted.get(seq)
        if seen is None and seq in self._waiting:
            seen = (self._waiting[seq].request_id, self._waiting[seq].digest)
        if seen is not None:
            request_id, seen_digest = seen
            if request_id is None:
                return fail(f"seq_id {seq} arrived after the later requests of this model had already run "
                            f"(it was given up on after waiting {self.gap_wait:.0f}s)")
            if seen_digest != digest:
                return fail(f"seq_id {seq} was already used by a different request on this model")
            return request_id
        if seq < self.next:
            return fail(f"seq_id {seq} is too old (this model is at seq_id {self.next})")
        loop = asyncio.get_running_loop()
        if not self._waiting:
            self._progress_at = loop.time()
        if seq == self.next:
            work = submit()  # a 429 propagates: nothing is recorded, the client re-sends
            request_id = add_future(work)
            self._record(seq, request_id, digest)
            self._drain()
            return request_id
        if len(self._waiting) >= self.max_waiting:
            raise WorkerError(429, "too_many_waiting_requests",
                              f"seq_id: {len(self._waiting)} requests of this model already wait for seq_id "
                              f"{self.next}; retry shortly", "seq_id")
        slot = loop.create_future()
        request_id = add_future(_when_submitted(slot))
        self._waiting[seq] = _Waiting(request_id, digest, submit, slot)
        self._schedule()
        return request_id

    def _record(self, seq: int, request_id: str | None, digest: str) -> None:
        self._admitted[seq] = (request_id, digest)
        while len(self._admitted) > self.keep:
            self._admitted.popitem(last=False)
        self.next = max(self.next, seq + 1)
        self._progress_at = asyncio.get_running_loop().time()

    def _drain(self) -> None:
        while self.next in self._waiting:
            waiting = self._waiting[self.next]
            try:
                work = waiting.submit()
            except WorkerError as exc:
                if exc.status == 429:
                    break  # queue full: retried by the timer
                waiting.slot.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - the request's own future carries the error
                waiting.slot.set_exception(exc)
            else:
                waiting.slot.set_result(work)
            del self._waiting[self.next]
            self._record(self.next, waiting.request_id, waiting.digest)
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiting:
            return
        loop = asyncio.get_running_loop()
        if self.next in self._waiting:  # held back by a full queue
            self._timer = loop.call_later(self.retry_after, self._drain)
        else:  # a gap: wait for the missing requests, but not forever
            self._timer = loop.call_at(self._progress_at + self.gap_wait, self._skip_gap)

    def _skip_gap(self) -> None:
        self._timer = None
        if not self._waiting or self.next in self._waiting:
            self._drain()
            return
        first = min(self._waiting)
        logger.warning("tinker: seq_id %d..%d never arrived within %.0fs; running seq_id %d and later without them",
                       self.next, first - 1, self.gap_wait, first)
        for missing in range(self.next, first):
            self._admitted[missing] = (None, "")
        self.next = first
        self._drain()
