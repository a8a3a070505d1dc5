"""HTTP plumbing of the PyTRIO protocol: its two planes' endpoints, bodies and error answers.

Control routes authenticate the API key (``Auth.tenant``: the SDK sends it as ``X-API-Key`` and as a bearer
token) and answer errors as ``{"code", "message", "field"}`` at the top level, where the SDK reads them. Actor
routes authenticate the run's actor token instead (tokens.py). Status codes are chosen for what the SDK does with
them: it retries 408, 429, 500 and 502-504 for 15 minutes, so a deterministic failure is never answered with one
(a 5xx becomes 400, a quota's 429 a 409; a full disk stays ``507 storage_full``, which it does not retry), except
``429 actor_capacity_exceeded`` on run creation, which makes the SDK wait for a free adapter slot, and a sample's
429, which is backpressure worth retrying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server_mock.api import bodies
from server_mock.api import endpoint as api_endpoint
from server_mock.api.auth import Auth
from server_mock.api.body_budget import OVER_BUDGET
from server_mock.api.browser_safety import JSON, require_media_type
from server_mock.errors import WorkerError

CONTROL_BODY_BYTES = 1 << 20  # Control bodies are a few hundred bytes; telemetry batches are capped here too
CAPACITY = "actor_capacity_exceeded"


def first_error(exc: PydanticValidationError, prefix: str = "") -> tuple[str, str]:
    """(field path, message) of a validation error's first problem, in the wire's own field names."""
    first = bodies.first_error(exc)  # never all the errors of a long list turned into dicts
    parts = [str(p) for p in first.get("loc", ()) if not str(p).startswith("function-")]
    loc = ".".join(([prefix] if prefix else []) + parts) or prefix or "body"
    return loc, f"{loc}: {first.get('msg', 'invalid')}"


def validated(model: type[BaseModel], data: Any, prefix: str = "") -> BaseModel:
    """``data`` as ``model``, or a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except PydanticValidationError as exc:
        loc, message = first_error(exc, prefix)
        raise WorkerError(400, "invalid_request", message, loc) from None


def error_body(exc: WorkerError) -> dict:
    body = {"code": exc.code, "message": exc.message}
    if exc.field:
        body["field"] = exc.field
    return body


def control_error(exc: WorkerError) -> JSONResponse:
    if exc.code == "too_many_adapters":  # the worker is full: the SDK waits on this code until a run is released
        exc = WorkerError(429, CAPACITY, exc.message + "; the SDK retries until one is released", exc.field)
    status = exc.status
    if status == 429 and exc.code not in (CAPACITY, OVER_BUDGET):
        status = 409  # a per-key limit: final, with its flag named
    elif status >= 500 and status != 507:
        status = 400  # never a 5xx the SDK would retry for 15 minutes (507, a full disk, it does not retry)
    return JSONResponse(error_body(exc), status_code=status)


def actor_error(exc: WorkerError) -> JSONResponse:
    status = 400 if exc.status >= 500 and exc.status != 507 else exc.status
    return JSONResponse(error_body(exc), status_code=status)


Handler = Callable[..., Awaitable[Any]]
BODILESS = ("GET", "HEAD", "OPTIONS", "DELETE")  # the SDK's bodyless POSTs (renew) send no Content-Type


def control_endpoint(handler: Handler, state, auth: Auth):
    """A Control route: the API key's tenant, a JSON body if any, ``handler(state, request, tenant)``."""

    async def run(request: Request, tenant: str):
        if api_endpoint.carries_body(request, BODILESS):
            require_media_type(request, (JSON,), f"the body of {request.method} {request.url.path}")
        return await handler(state, request, tenant)

    return api_endpoint.endpoint(run, tenant_of=auth.tenant, render_error=control_error, protocol="pytrio")


def actor_endpoint(handler: Handler, state, media: tuple[str, ...] = (JSON,)):
    """An Actor route: ``handler(state, request)`` resolves the caller from its actor token itself."""

    async def run(request: Request, tenant: str):
        if api_endpoint.carries_body(request, BODILESS):
            require_media_type(request, media, f"the body of {request.method} {request.url.path}")
        return await handler(state, request)

    return api_endpoint.endpoint(run, tenant_of=lambda r: "", render_error=actor_error, public=True,
                                 protocol="pytrio")


async def read_model(request: Request, model: type[BaseModel], limit: int = CONTROL_BODY_BYTES) -> BaseModel:
    """The JSON body as ``model`` (``{}`` when empty), parsed off the loop when large; 400 naming a bad field."""
    data, raw = await bodies.read_json(request, limit, empty={})
    if not isinstance(data, dict):
        raise WorkerError(400, "invalid_json", "body: expected a JSON object", "body")
    if len(raw) > bodies.BIG_BODY_BYTES:
        return await asyncio.to_thread(validated, model, data)
    return validated(model, data)


def query(request: Request, model: type[BaseModel]) -> BaseModel:
    return validated(model, dict(request.query_params))


def no_content() -> Response:
    return Response(status_code=204)
