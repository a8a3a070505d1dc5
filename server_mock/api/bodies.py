"""Request bodies, for every protocol: read within a size limit (optionally zstd-compressed), and parsed as
JSON or into a pydantic model, off the event loop when large.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request

from server_mock.errors import WorkerError

BIG_BODY_BYTES = 1 << 20  # bodies above this are joined and parsed off the event loop


def _too_large(limit: int, declared: str | None = None, what: str = "") -> WorkerError:
    size = f"{declared} bytes exceeds" if declared is not None else "exceeds"
    return WorkerError(413, "body_too_large", f"body: {size} limit max_body_bytes={limit}{what}", "body")


async def read_body(request: Request, limit: int, *, allow_zstd: bool = False) -> bytes:
    """The body's bytes, at most ``limit`` of them (413 naming the limit). With ``allow_zstd``, a body sent with
    ``Content-Encoding: zstd`` is decompressed, and the limit applies to what it decompresses to."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, declared)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    if len(chunks) == 1:
        raw = chunks[0]
    else:
        raw = await asyncio.to_thread(b"".join, chunks) if size > BIG_BODY_BYTES else b"".join(chunks)
    if allow_zstd and request.headers.get("content-encoding", "").lower() == "zstd":
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
        raise _too_large(limit, what=" uncompressed")
    return out


def parse_json(raw: bytes, empty: Any = None) -> Any:
    """``raw`` as JSON (``empty`` for an empty body); 400 naming the body if it is not JSON."""
    try:
        return json.loads(raw) if raw else empty
    except ValueError:
        raise WorkerError(400, "invalid_json", "body: not valid JSON", "body") from None
    except RecursionError:
        raise WorkerError(400, "invalid_json", "body: JSON nested too deeply", "body") from None


async def read_json(request: Request, limit: int, *, allow_zstd: bool = False, empty: Any = None
                    ) -> tuple[Any, bytes]:
    """The body parsed as JSON (off the event loop when large), and its bytes."""
    raw = await read_body(request, limit, allow_zstd=allow_zstd)
    if len(raw) > BIG_BODY_BYTES:
        return await asyncio.to_thread(parse_json, raw, empty), raw
    return parse_json(raw, empty), raw


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """``raw`` validated into ``model``; a 400 for JSON that does not parse, a 422 naming the first bad field."""
    try:
        return model.model_validate_json(raw)
    except PydanticValidationError as exc:
        if any(e.get("type") in ("json_invalid", "json_type") for e in exc.errors()):
            raise WorkerError(400, "invalid_json", "body: not valid JSON (or not UTF-8)", "body") from None
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("function-"))
        raise WorkerError(422, "invalid_request_body", f"{loc or 'body'}: {first.get('msg', 'invalid')}",
                          loc or "body") from None


async def read_model(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """The body validated into ``model`` (parsed off the event loop when large)."""
    raw = await read_body(request, limit)
    if len(raw) > BIG_BODY_BYTES:
        return await asyncio.to_thread(parse_body, model, raw)
    return parse_body(model, raw)
