"""Tinker futures: every operation answers at once with ``{"request_id"}``; the client then long-polls
``retrieve_future``.

A future here is an asyncio task that yields the final answer: a dict (sent as JSON) or bytes (sent as
protobuf), or raises ``TinkerFailure`` (sent as ``{"error", "category"}``). Ordering of one model's
requests is ``gate.SeqGate``'s job.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from server_mock.api.tinker import schemas
from server_mock.api.tinker.endpoint import PROTOBUF, read
from server_mock.api.tinker.paths import tinker_message
from server_mock.api.tinker.proto.decode import ProtoError
from server_mock.engine.queue import SERVER_ERROR_CODES
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")

LONG_POLL_SECONDS = 30.0  # retrieve_future holds a pending future this long (the client gives up at 45 s)


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
        first = exc.errors()[0]
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


class Futures:
    """request_id -> Future. Past ``max_entries`` futures of one tenant, that tenant's oldest are forgotten;
    another tenant's never are."""

    def __init__(self, max_entries: int = 20_000) -> None:
        self.max_entries = max_entries
        self._items: dict[str, Future] = {}
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}

    @staticmethod
    def new_id() -> str:
        return f"tk-{uuid.uuid4().hex}"

    def add(self, tenant: str, work: Awaitable[Any], request_id: str | None = None) -> str:
        request_id = request_id or self.new_id()
        task = asyncio.ensure_future(work)
        task.add_done_callback(_consume_exception)
        self._items[request_id] = Future(request_id, tenant, task)
        mine = self._by_tenant.setdefault(tenant, OrderedDict())
        mine[request_id] = None
        while len(mine) > self.max_entries:
            old_id, _ = mine.popitem(last=False)
            old = self._items.pop(old_id, None)
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
        return future


def _consume_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved; the poller reads it again from the task


# --- route --------------------------------------------------------------------------------------------


async def retrieve_future(state, request: Request, tenant: str):
    body, _ = await read(request, schemas.RetrieveFuture, state.json_limit)
    request_id = body.request_id
    future = state.futures.get(request_id, tenant)
    if future is None:
        raise WorkerError(404, "request_not_found", f"request_id: unknown request {request_id!r} "
                                                    "(expired, or the worker restarted)", "request_id")
    await asyncio.wait({future.task}, timeout=LONG_POLL_SECONDS)
    if not future.task.done():
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
