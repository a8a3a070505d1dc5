"""What every native route shares: API keys, the endpoint wrapper (auth, body parsing, errors), bodies,
long polls and idempotency. The service and auth are reached through ``request.app.state``."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from typing import Any, Awaitable, Callable

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pytrio_compat.wire import ErrorBody, ErrorResponse
from server_mock.api.bodies import BIG_BODY_BYTES, parse_body, read_body
from server_mock.api.browser_safety import require_media_type
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")
MAX_POLL_SECONDS = 60.0
Handler = Callable[..., Awaitable[Any]]


class Idempotency:
    """A create request resent with the same Idempotency-Key gets the first answer, not a second object."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._results: dict[str, Any] = {}

    async def remember(self, request: Request, tenant: str, make: Callable[[], Awaitable[Any]]) -> Any:
        key = request.headers.get("idempotency-key")
        key = f"{tenant}:{key}" if key else None  # one tenant's key never answers with another's object
        if key and key in self._results:
            return self._results[key]
        result = await make()
        if key:
            self._results[key] = result
            if len(self._results) > self.keep:
                self._results.pop(next(iter(self._results)))
        return result


def service_of(request: Request):
    return request.app.state.service


def error_response(exc: WorkerError, request_id: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message, field=exc.field))
    headers = {"x-request-id": request_id}
    if exc.status == 429:
        headers["Retry-After"] = "1"
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


def endpoint(handler: Handler, body_model: type[BaseModel] | None = None, public: bool = False):
    """A Starlette endpoint around ``handler(request, tenant[, body=...])``: authenticates (unless public),
    parses and validates a JSON body into ``body_model``, and turns every failure into a 4xx/5xx naming why."""

    async def wrapped(request: Request) -> Response:
        request_id = uuid.uuid4().hex[:12]
        try:
            tenant = "" if public else request.app.state.auth.tenant(request)
            kwargs: dict[str, Any] = {}
            if body_model is not None:
                require_media_type(request)
                raw = await read_body(request, service_of(request).limits.max_body_bytes)
                # a large body is parsed (and its tensors' base64 text copied) in a worker thread
                if len(raw) > BIG_BODY_BYTES:
                    kwargs["body"] = await asyncio.to_thread(parse_body, body_model, raw)
                else:
                    kwargs["body"] = parse_body(body_model, raw)
            result = await handler(request, tenant, **kwargs)
        except WorkerError as exc:
            return error_response(exc, request_id)
        except ClientDisconnect:  # the client went away mid-body: nothing was queued, nobody to answer
            logger.debug("client disconnected while sending %s", request.url.path)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - never a bare 500 without a message
            logger.exception("unhandled error in %s", request.url.path)
            return error_response(WorkerError(500, "internal_error", f"{type(exc).__name__}: {exc}"), request_id)
        if isinstance(result, Response):
            return result
        payload = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
        return JSONResponse(payload, headers={"x-request-id": request_id})

    return wrapped


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
