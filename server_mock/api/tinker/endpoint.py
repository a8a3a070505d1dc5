"""HTTP plumbing of the Tinker API: API keys (with Tinker's ``tml-`` prefix), bodies (declared in schemas.py) and
error answers in Tinker's shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from server_mock.api import bodies
from server_mock.api import endpoint as api_endpoint
from server_mock.api.auth import Auth
from server_mock.api.browser_safety import JSON, require_media_type
from server_mock.api.tinker.paths import tinker_message
from server_mock.api.tinker.schemas import TinkerBody, parse
from server_mock.errors import WorkerError

PROTOBUF = "application/x-protobuf"


class _KeyOnly:
    def __init__(self, key: str) -> None:
        self.headers = {"x-api-key": key}


def tenant_of(auth: Auth, request: Request) -> str:
    """The worker's API keys, sent as ``X-API-Key`` by the tinker client. The client insists on a
    ``tml-`` prefix, so a worker key ``K`` is also accepted as ``tml-K``."""
    try:
        return auth.tenant(request)
    except WorkerError as exc:
        if exc.status == 403:  # an operator key: refused as it is
            raise
        key = request.headers.get("x-api-key", "")
        if key.startswith("tml-"):
            try:
                return auth.tenant(_KeyOnly(key[4:]))
            except WorkerError as inner:
                if inner.status == 403:
                    raise
        raise WorkerError(401, "unauthorized", "missing or invalid API key: pass the worker's --api-key as "
                                               "api_key= (or TINKER_API_KEY); a key K also works as 'tml-K'") from None


def error_response(exc: WorkerError) -> JSONResponse:
    # The tinker client re-sends on 408/409/429/5xx for minutes: answer final errors with a final status. A full
    # disk stays 507 (storage_full): re-sending it for a while is what its message asks (free space and retry).
    status = exc.status
    if status == 409:
        status = 400
    elif status >= 500 and status != 507:
        status = 422
    return JSONResponse({"detail": tinker_message(exc.message, exc.field), "code": exc.code, "field": exc.field},
                        status_code=status)


def endpoint(handler: Callable[..., Awaitable[Any]], state, auth: Auth, public: bool = False,
             media: tuple[str, ...] = (JSON,)):
    """A Tinker route: the caller's tenant, the body's media type (one of ``media``), then
    ``handler(state, request, tenant)``; errors answered in Tinker's shape."""
    what = f"the body of {handler.__name__}"

    async def run(request: Request, tenant: str):
        if api_endpoint.carries_body(request):
            require_media_type(request, media, what)
        return await handler(state, request, tenant)

    return api_endpoint.endpoint(run, tenant_of=lambda request: tenant_of(auth, request), render_error=error_response,
                                 public=public, protocol="tinker")


async def read_body(request: Request, limit: bodies.BodyLimit, json_values: bool = True) -> bytes:
    return await bodies.read_body(request, limit, allow_zstd=True, json_values=json_values)


async def read(request: Request, model: type[TinkerBody], limit: bodies.BodyLimit) -> tuple[Any, int]:
    """The body (zstd allowed) validated into ``model`` (in a thread, within the parse budget, when large), and
    its size in bytes."""
    body, raw = await bodies.read_model_raw(request, model, limit, allow_zstd=True, parse=parse)
    body.received(digest(raw))
    return body, len(raw)


digest = api_endpoint.fingerprint  # a re-sent request's body has the same bytes


async def read_json(request: Request, limit: bodies.BodyLimit) -> dict:
    """The body as a JSON object (zstd allowed), for routes that check it themselves."""
    body, _ = await bodies.read_json(request, limit, allow_zstd=True, empty={})
    if not isinstance(body, dict):
        raise WorkerError(400, "invalid_json", "body: expected a JSON object", "body")
    return body
