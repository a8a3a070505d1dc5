"""What every native route shares: the endpoint (auth, a typed JSON body, errors in the native shape),
long polls and idempotency. The service, API keys and idempotency cache are reached through
``request.app.state``."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Awaitable, Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

from pytrio_compat.wire import ErrorBody, ErrorResponse
from server_mock.api import endpoint as api_endpoint
from server_mock.api.bodies import json_limit, read_model_raw, tensor_limit
from server_mock.api.browser_safety import require_media_type
from server_mock.errors import WorkerError
from server_mock.service.quotas import TenantLRU
from server_mock.service.worker import WorkerService

MAX_POLL_SECONDS = 60.0
Handler = Callable[..., Awaitable[Any]]


class Idempotency:
    """A create request resent with the same Idempotency-Key gets the first answer, not a second object. Each
    tenant keeps its own ``keep`` most recent keys: one tenant's volume never evicts another's."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._results: TenantLRU[Any] = TenantLRU(keep)

    async def remember(self, request: Request, tenant: str, make: Callable[[], Awaitable[Any]]) -> Any:
        key = request.headers.get("idempotency-key")
        if not key:
            return await make()
        key = f"{tenant}:{key}"  # one tenant's key never answers with another's object
        known = self._results.get(key)
        if known is not None:
            return known
        result = await make()
        self._results.put(key, tenant, result)
        return result


def service_of(request: Request) -> WorkerService:
    return request.app.state.service


def error_response(exc: WorkerError) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message, field=exc.field))
    return JSONResponse(body.model_dump(), status_code=exc.status)


def _tenant(request: Request) -> str:
    return request.app.state.auth.tenant(request)


def endpoint(handler: Handler, body_model: type[BaseModel] | None = None, public: bool = False,
             tensors: bool = False, fingerprinted: bool = False):
    """A native route around ``handler(request, tenant[, body=...])``: the caller's tenant (unless public), the
    JSON body validated into ``body_model`` (parsed off the event loop when large), native error answers. A body
    is within ``--max-json-body-bytes``, or ``--max-body-bytes`` on a route whose bodies carry ``tensors``; a
    ``fingerprinted`` route's handler also gets ``fingerprint=``, that of the body's bytes."""

    async def run(request: Request, tenant: str):
        if body_model is None:
            return await handler(request, tenant)
        require_media_type(request)
        limits = service_of(request).limits
        body, raw = await read_model_raw(request, body_model, tensor_limit(limits) if tensors else json_limit(limits))
        if fingerprinted:
            return await handler(request, tenant, body=body, fingerprint=api_endpoint.fingerprint(raw))
        return await handler(request, tenant, body=body)

    return api_endpoint.endpoint(run, tenant_of=_tenant, render_error=error_response, public=public)


def poll_seconds(request: Request) -> float:
    """The ``wait`` query parameter of a long poll: finite, >= 0, at most MAX_POLL_SECONDS."""
    raw = request.query_params.get("wait", "0")
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait) or wait < 0:
        raise WorkerError(400, "invalid_query", f"wait: must be a number of seconds in [0, {MAX_POLL_SECONDS:g}] "
                                                f"(longer waits are cut to {MAX_POLL_SECONDS:g}), got {raw!r}", "wait")
    return min(wait, MAX_POLL_SECONDS)


async def wait_unless_disconnected(request: Request, wait: Awaitable[None]) -> bool:
    """Run ``wait``; stop early (returning False) if the client disconnects meanwhile."""

    async def disconnected() -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - cannot tell: just wait for the request
            await asyncio.Event().wait()

    waiter, watcher = asyncio.ensure_future(wait), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        watcher.cancel()
    return not (watcher.done() and not watcher.cancelled())
