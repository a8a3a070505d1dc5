"""HTTP plumbing of the Tinker API: API keys, bounded bodies, JSON fields and error answers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server_mock.api.browser_safety import JSON, require_media_type
from server_mock.api.tinker.paths import tinker_message
from server_mock.errors import WorkerError, bad_request

logger = logging.getLogger("server_mock")

PROTOBUF = "application/x-protobuf"
BIG_BODY_BYTES = 1 << 20  # bodies above this are parsed off the event loop


class _KeyOnly:
    def __init__(self, key: str) -> None:
        self.headers = {"x-api-key": key}


def tenant_of(auth, request: Request) -> str:
    """The worker's API keys, sent as ``X-API-Key`` by the tinker client. The client insists on a
    ``tml-`` prefix, so a worker key ``K`` is also accepted as ``tml-K``."""
    try:
        return auth.tenant(request)
    except WorkerError:
        key = request.headers.get("x-api-key", "")
        if key.startswith("tml-"):
            try:
                return auth.tenant(_KeyOnly(key[4:]))
            except WorkerError:
                pass
        raise WorkerError(401, "unauthorized", "missing or invalid API key: pass the worker's --api-key as "
                                               "api_key= (or TINKER_API_KEY); a key K also works as 'tml-K'") from None


def error_response(exc: WorkerError) -> JSONResponse:
    # The tinker client re-sends on 408/409/429/5xx for minutes: answer final errors with a final status.
    status = exc.status
    if status == 409:
        status = 400
    elif status >= 500:
        status = 422
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse({"detail": tinker_message(exc.message, exc.field), "code": exc.code, "field": exc.field},
                        status_code=status, headers=headers)


def endpoint(handler: Callable[..., Awaitable[Any]], state, auth, public: bool = False,
             media: tuple[str, ...] = (JSON,)):
    """A Starlette endpoint: the caller's tenant, the body's media type (one of ``media``), then
    ``handler(state, request, tenant)``; a dict answer is sent as JSON, a WorkerError as its 4xx,
    anything unexpected as a logged 422."""
    what = f"the body of {handler.__name__}"

    async def wrapped(request: Request) -> Response:
        try:
            tenant = "" if public else tenant_of(auth, request)
            if carries_body(request):
                require_media_type(request, media, what)
            result = await handler(state, request, tenant)
        except WorkerError as exc:
            return error_response(exc)
        except Exception as exc:
            logger.exception("tinker: unhandled error in %s", request.url.path)
            return error_response(WorkerError(500, "internal_error", f"{type(exc).__name__}: {exc}"))
        return result if isinstance(result, Response) else JSONResponse(result)

    return wrapped


def carries_body(request: Request) -> bool:
    """Whether a request has (or announces) a body: one whose media type must then be checked. The
    tinker client sends ``Content-Type: application/json`` even on its POSTs without a body."""
    if request.method in ("GET", "HEAD", "OPTIONS"):
        return False  # a body there means nothing to any route
    headers = request.headers
    if "content-type" in headers or "transfer-encoding" in headers:
        return True
    return headers.get("content-length", "0").strip() not in ("", "0")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise WorkerError(413, "body_too_large", f"body: {declared} bytes exceeds limit max_body_bytes={limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise WorkerError(413, "body_too_large", f"body: exceeds limit max_body_bytes={limit}")
        chunks.append(chunk)
    if len(chunks) == 1:
        raw = chunks[0]
    else:
        raw = await asyncio.to_thread(b"".join, chunks) if size > BIG_BODY_BYTES else b"".join(chunks)
    if request.headers.get("content-encoding", "").lower() == "zstd":
        raw = await asyncio.to_thread(_unzstd, raw, limit)
    return raw


def _unzstd(raw: bytes, limit: int) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise WorkerError(415, "unsupported_encoding", "zstd bodies need the zstandard package on the worker") from None
    try:
        out = zstandard.ZstdDecompressor().stream_reader(raw).read(limit + 1)
    except zstandard.ZstdError as exc:
        raise WorkerError(400, "invalid_encoding", f"body: not valid zstd ({exc})") from None
    if len(out) > limit:
        raise WorkerError(413, "body_too_large", f"body: exceeds limit max_body_bytes={limit} uncompressed")
    return out


async def read_json(request: Request, limit: int) -> dict:
    return (await read_json_sized(request, limit))[0]


async def read_json_sized(request: Request, limit: int) -> tuple[dict, int, str]:
    """The JSON object of the body, the body's size in bytes, and its digest (for re-sent requests).
    A large body is parsed and hashed off the event loop."""
    raw = await read_body(request, limit)
    if len(raw) > BIG_BODY_BYTES:
        return await asyncio.to_thread(_parse_json, raw)
    return _parse_json(raw)


def _parse_json(raw: bytes) -> tuple[dict, int, str]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise WorkerError(400, "invalid_json", "body: not valid JSON") from None
    except RecursionError:
        raise WorkerError(400, "invalid_json", "body: JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise WorkerError(400, "invalid_json", "body: expected a JSON object")
    return body, len(raw), digest(body)


def field(body: dict, name: str, kind: type | tuple, required: bool = True, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(name, "required")
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(name, f"must be an integer, got {value!r}")
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad_request(name, f"has the wrong type ({type(value).__name__})")
    return value


def digest(body: Any) -> str:
    raw = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()
