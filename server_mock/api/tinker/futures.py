"""Tinker futures: every operation answers at once with ``{"request_id"}``; the client then long-polls
``retrieve_future``.

A future here is an asyncio task that yields the final answer: a dict (sent as JSON) or bytes (sent as
protobuf), or raises ``TinkerFailure`` (sent as ``{"error", "category"}``). Ordering of one model's
requests is ``gate.SeqGate``'s job.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from server_mock.api.long_polls import held_poll
from server_mock.api.bodies import first_error
from server_mock.api.tinker import schemas
from server_mock.api.tinker.endpoint import PROTOBUF, read
from server_mock.api.tinker.paths import tinker_message
from server_mock.api.tinker.proto.decode import ProtoError
from server_mock.engine.jobs import SERVER_ERROR_CODES
from server_mock.engine.requests import FinishedResults, approx_bytes
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")

LONG_POLL_SECONDS = 30.0  # retrieve_future holds a pending future this long (the client gives up at 45 s)
PAUSED_POLL_SECONDS = 1.0  # ... and one held back by its key's token budget this long, so its state stays current


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


def to_failure(exc: BaseException) -> TinkerFailure:
    """Any error as the failure the client is shown."""
    if isinstance(exc, TinkerFailure):
        return exc
    if isinstance(exc, WorkerError):
        failure = TinkerFailure.from_worker_error(exc)
        failure.message = tinker_message(failure.message, exc.field)
        return failure
    if isinstance(exc, ValidationError):
        first = first_error(exc)
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return TinkerFailure(f"{loc or 'request'}: {first.get('msg', 'invalid')}", "user")
    if isinstance(exc, ProtoError):
        return TinkerFailure(f"malformed protobuf body: {exc}", "user")
    return TinkerFailure(f"{type(exc).__name__}: {exc}", "server")


async def raise_(exc: BaseException) -> Any:
    raise exc


async def guard(work: Awaitable[Any]) -> Any:
    """Every failure reaches the client as a failed future with a readable message."""
    try:
        return await work
    except Exception as exc:  # noqa: BLE001
        raise to_failure(exc) from None


@dataclass
class Future:
    request_id: str
    tenant: str
    task: asyncio.Task
    finished: float | None = None  # loop time
    size: int = 0
    wanted: asyncio.Event | None = None  # a lazy future's work starts when it is first polled
    # why the request is held back by its key's token budget (None: it is not): Tinker's ``paused_rate_limit``
    paused: str | None = None
    pause_began: asyncio.Event | None = None  # set when a pause begins: a poll held meanwhile answers at once


BOOT = secrets.token_hex(4)  # this process's mark in its future ids: an id with another one is from before a restart
_ID_RE = re.compile(r"^tk-(?P<boot>[0-9a-f]{8})[0-9a-f]{32}\Z")


class Futures:
    """request_id -> Future, per tenant: past ``max_entries`` futures of one tenant, that tenant's oldest are
    forgotten (another tenant's never are). A finished future is kept ``ttl`` seconds, and while a tenant's
    finished futures hold more than ``max_bytes`` its oldest finished ones are forgotten (the newest stays);
    a forgotten future answers 404."""

    def __init__(self, max_entries: int = 20_000, ttl: float = 3600.0, max_bytes: int = 1 << 30,
                 durable: bool = False) -> None:
        self.durable = durable  # --durability full: futures are journaled and restored after a restart
        self.max_entries = max_entries
        self.ttl = ttl
        self.max_bytes = max_bytes
        self._items: dict[str, Future] = {}
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        self._results = FinishedResults(ttl, max_bytes)  # the finished ones, per tenant: their bytes and age
        self._next_sweep = 0.0

    @staticmethod
    def new_id() -> str:
        return f"tk-{BOOT}{uuid.uuid4().hex}"

    def from_before_restart(self, request_id: str) -> bool:
        """Whether ``request_id`` was given out by an earlier process of this worker (``--durability full``)."""
        match = _ID_RE.match(request_id) if self.durable else None
        return match is not None and match["boot"] != BOOT

    def add_lazy(self, tenant: str, make: Callable[[], Awaitable[Any]], request_id: str) -> str:
        """A future whose work (``make()``) starts when it is first polled: one restored after a restart whose
        answer makes something (a sampler) that nobody may ask for again."""
        wanted = asyncio.Event()

        async def when_wanted() -> Any:
            await wanted.wait()
            return await make()

        self.add_guarded(tenant, when_wanted(), request_id)
        self._items[request_id].wanted = wanted
        return request_id

    def add(self, tenant: str, work: Awaitable[Any], request_id: str | None = None) -> str:
        request_id = request_id or self.new_id()
        self._sweep()
        task = asyncio.ensure_future(work)
        task.add_done_callback(_consume_exception)
        future = Future(request_id, tenant, task)
        task.add_done_callback(lambda _: self._done(future))
        self._forget(request_id)  # a re-used id (a failed asample, then its retry) replaces the old future
        self._items[request_id] = future
        mine = self._by_tenant.setdefault(tenant, OrderedDict())
        mine[request_id] = None
        while len(mine) > self.max_entries:
            old_id = next(iter(mine))
            old = self._items.get(old_id)
            self._forget(old_id)
            if old is not None and not old.task.done():
                old.task.cancel()
        return request_id

    def add_guarded(self, tenant: str, work: Awaitable[Any], request_id: str | None = None) -> str:
        return self.add(tenant, guard(work), request_id)

    def add_failed(self, tenant: str, failure: BaseException) -> str:
        return self.add(tenant, raise_(to_failure(failure)))

    def get(self, request_id: str, tenant: str) -> Future | None:
        future = self._items.get(request_id)
        if future is None or future.tenant != tenant:
            return None
        if future.finished is not None and _now() - future.finished > self.ttl:
            self._forget(request_id)
            return None
        return future

    def set_paused(self, request_id: str, reason: str | None) -> None:
        """The request is held back by its key's token budget, for ``reason`` (None: no longer): what
        ``retrieve_future`` answers meanwhile is ``try_again`` with ``queue_state: paused_rate_limit``."""
        future = self._items.get(request_id)
        if future is None:
            return
        future.paused = reason
        if reason is None:
            future.pause_began = None
        elif future.pause_began is not None:
            future.pause_began.set()

    def held_bytes(self, tenant: str) -> int:
        return self._results.held_bytes(tenant)

    def why_gone(self, request_id: str, tenant: str) -> str:
        """Why an unknown future of ``tenant`` may be unknown, for the 404."""
        if self._results.dropped_for_bytes(request_id, tenant):
            return (f"dropped: this API key's finished results held more than max_result_bytes={self.max_bytes} "
                    "bytes, and the oldest go first")
        return f"expired after {self.ttl:g} s, or the worker restarted"

    def _done(self, future: Future) -> None:
        if self._items.get(future.request_id) is not future:
            return  # forgotten (or replaced) before it finished
        future.finished = _now()
        future.size = _result_bytes(future.task)
        for oldest in self._results.add(future.tenant, future.request_id, future.size, future.finished):
            self._forget(oldest)

    def _forget(self, request_id: str) -> None:
        future = self._items.pop(request_id, None)
        if future is None:
            return
        mine = self._by_tenant.get(future.tenant)
        if mine is not None:
            mine.pop(request_id, None)
            if not mine:
                del self._by_tenant[future.tenant]
        self._results.remove(future.tenant, request_id)

    def _sweep(self) -> None:
        """Forget expired futures, at most every ttl/2 seconds (each lookup checks its own future's age too)."""
        now = _now()
        if now < self._next_sweep:
            return
        self._next_sweep = now + max(0.05, self.ttl / 2)
        for _, request_id in self._results.expired(now):
            self._forget(request_id)


def _now() -> float:
    return time.monotonic()


def _result_bytes(task: asyncio.Task) -> int:
    if task.cancelled() or task.exception() is not None:
        return 256
    return approx_bytes(task.result())


def _consume_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved; the poller reads it again from the task


# --- route --------------------------------------------------------------------------------------------


async def retrieve_future(state, request: Request, tenant: str):
    body, _ = await read(request, schemas.RetrieveFuture, state.json_limit)
    request_id = body.request_id
    future = state.futures.get(request_id, tenant)
    if future is None and state.futures.from_before_restart(request_id):
        # accepted before a restart and not recorded (a refused or still-waiting op, or one whose result expired):
        # 410 makes the tinker SDK send a sample request again; a training future raises it to the script
        raise WorkerError(410, "request_lost_in_restart", f"request_id: {request_id[:80]!r} was given out before the "
                                                          "worker restarted and was not recorded; send it again",
                          "request_id")
    if future is None:
        raise WorkerError(404, "request_not_found", f"request_id: unknown request {request_id[:80]!r} "
                                                    f"({state.futures.why_gone(request_id, tenant)})", "request_id")
    if future.wanted is not None:
        future.wanted.set()
    # one of the tenant's few held polls (api/long_polls.py): ended early, it answers try_again like a timeout
    await held_poll(request, tenant, _until_done_or_paused(future))
    if not future.task.done():
        if future.paused is not None:  # held back by the key's token budget: the SDK shows paused_rate_limit
            return {"type": "try_again", "request_id": request_id, "queue_state": "paused_rate_limit",
                    "queue_state_reason": future.paused}
        return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    if future.task.cancelled():
        return {"error": "the request was dropped (too many pending requests)", "category": "server"}
    exc = future.task.exception()
    if exc is not None:
        failure = to_failure(exc)
        return {"error": failure.message, "category": failure.category}
    result = future.task.result()
    if isinstance(result, bytes):
        return Response(result, media_type=PROTOBUF)
    return result


async def _until_done_or_paused(future: Future) -> None:
    """Wait for the future: at most ``LONG_POLL_SECONDS``, or ``PAUSED_POLL_SECONDS`` while (or once) its request is
    held back by its key's token budget, so that the client learns of the pause, and of its end, within a second."""
    if future.paused is not None:
        await asyncio.wait({future.task}, timeout=PAUSED_POLL_SECONDS)
        return
    if future.pause_began is None:
        future.pause_began = asyncio.Event()
    began = asyncio.ensure_future(future.pause_began.wait())
    try:
        await asyncio.wait({future.task, began}, timeout=LONG_POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
    finally:
        began.cancel()
