"""The one way a route becomes a Starlette endpoint, for every protocol.

``endpoint(handler, tenant_of=..., render_error=...)`` authenticates the caller (unless the route is public),
runs ``handler(request, tenant)`` and answers: a ``Response`` as is, a pydantic model or a dict as JSON, a
``WorkerError`` through the protocol's own error renderer (a 429 with ``Retry-After``), a client that went away
with 499, and anything unexpected as a logged 500 with a message (which the renderer may map to its protocol's
status). Every answer carries an ``x-request-id`` that the log lines of the request also name.

``fingerprint(raw)`` is what tells a re-sent request (the same bytes) from a different one under the same id, in
every protocol: the SHA-256 of the body as received, never of a re-serialised model.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from server_mock.api.body_budget import TENANT_SCOPE_KEY
from server_mock.errors import WorkerError, is_disk_full, storage_error

logger = logging.getLogger("server_mock")

Handler = Callable[[Request, str], Awaitable[Any]]
TenantOf = Callable[[Request], str]
RenderError = Callable[[WorkerError], Response]


def fingerprint(raw: bytes) -> str:
    """A request body's fingerprint: the hex SHA-256 of its bytes as received."""
    return hashlib.sha256(raw).hexdigest()


def carries_body(request: Request, bodiless: tuple[str, ...] = ("GET", "HEAD", "OPTIONS")) -> bool:
    """Whether a request has (or announces) a body, whose media type must then be checked. A method in
    ``bodiless`` never does (a body there means nothing to any route); clients send ``Content-Type`` even on
    some POSTs without a body, so its length decides."""
    if request.method in bodiless:
        return False
    headers = request.headers
    if "content-type" in headers or "transfer-encoding" in headers:
        return True
    return headers.get("content-length", "0").strip() not in ("", "0")


def endpoint(handler: Handler, *, tenant_of: TenantOf, render_error: RenderError, public: bool = False,
             protocol: str = "") -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        request_id = uuid.uuid4().hex[:12]
        tenant = ""
        try:
            tenant = "" if public else tenant_of(request)
            request.scope[TENANT_SCOPE_KEY] = tenant  # what its body holds is charged to it (api/body_budget.py)
            result = await handler(request, tenant)
        except WorkerError as exc:
            if tenant:
                _refused(request, tenant, exc)
            response = render_error(exc)
            if response.status_code == 429:  # every protocol's clients are told when to retry
                response.headers.setdefault("Retry-After", str(exc.retry_after))
            return _tagged(response, request_id)
        except ClientDisconnect:  # the client went away mid-body: nothing was queued, nobody to answer
            logger.debug("client disconnected while sending %s", request.url.path)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - never a bare 500 without a message
            if is_disk_full(exc):  # a write under --storage the disk refused: 507, as every recorded write
                logger.error("%s: %s", request.url.path, exc)
                return _tagged(render_error(storage_error(request.url.path, exc)), request_id)
            logger.exception("%sunhandled error in %s (request %s)", f"{protocol}: " if protocol else "",
                             request.url.path, request_id)
            return _tagged(render_error(WorkerError(500, "internal_error", f"{type(exc).__name__}: {exc}")),
                           request_id)
        if isinstance(result, Response):
            return _tagged(result, request_id)
        payload = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
        return JSONResponse(payload, headers={"x-request-id": request_id})

    return wrapped


def _refused(request: Request, tenant: str, exc: WorkerError) -> None:
    """A caller's request answered with an error: the operator's console lists it (service/usage.py)."""
    usage = getattr(getattr(request.app.state, "service", None), "usage", None)
    if usage is not None:
        usage.refused(tenant, f"{request.method} {request.url.path}"[:200], exc.status, exc.code, exc.message)


def _tagged(response: Response, request_id: str) -> Response:
    response.headers.setdefault("x-request-id", request_id)
    return response
