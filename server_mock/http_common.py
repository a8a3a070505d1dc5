"""What every native route shares: API keys, the endpoint wrapper (auth, body parsing, errors), bodies,
long polls and idempotency. The service and auth are reached through ``request.app.state``."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import uuid
from typing import Any, Awaitable, Callable

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pytrio_compat.wire import ErrorBody, ErrorResponse

from .browser_safety import require_media_type
from .errors import WorkerError

logger = logging.getLogger("server_mock")
MAX_POLL_SECONDS = 60.0
BIG_BODY_BYTES = 1 << 20  # bodies above this are joined and parsed off the event loop
Handler = Callable[..., Awaitable[Any]]


class Auth:
    """API keys, each a tenant. Compared in constant time; with no keys configured, everyone is one tenant."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    def tenant(self, request: Request) -> str:
        if not self._keys:
            return "default"
        given = request.headers.get("x-api-key", "")
        auth = request.headers.get("authorization", "")
        if not given and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        candidate = given.encode()
        match = None
        for key in self._keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(candidate, key):
                match = key
        if match is None:
            raise WorkerError(401, "unauthorized", "missing or invalid API key (send Authorization: Bearer KEY)")
        return "tenant-" + hashlib.sha256(match).hexdigest()[:16]


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


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    try:
        return model.model_validate_json(raw)
    except PydanticValidationError as exc:
        if any(e.get("type") in ("json_invalid", "json_type") for e in exc.errors()):
            raise WorkerError(400, "invalid_json", "body: not valid JSON (or not UTF-8)", "body") from None
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("function-"))
        raise WorkerError(422, "invalid_request_body", f"{loc or 'body'}: {first.get('msg', 'invalid')}",
                          loc or "body") from None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise WorkerError(413, "body_too_large", f"body: {declared} bytes exceeds limit max_body_bytes={limit}", "body")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise WorkerError(413, "body_too_large", f"body: exceeds limit max_body_bytes={limit}", "body")
        chunks.append(chunk)
    if len(chunks) == 1:
        return chunks[0]
    return await asyncio.to_thread(b"".join, chunks) if size > BIG_BODY_BYTES else b"".join(chunks)


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
