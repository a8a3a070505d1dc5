"""Request bodies: read within a size limit, and parsed (off the event loop when large)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request

from server_mock.errors import WorkerError

BIG_BODY_BYTES = 1 << 20  # bodies above this are joined and parsed off the event loop


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
