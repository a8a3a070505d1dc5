"""The operator's view of the worker (docs/operations.md): ``GET /metrics`` (Prometheus text), ``GET /console`` (one
page, no key needed to load it), ``GET /operator/state`` (the console's data) and ``GET /operator/traces/...`` (a
run's, sampler's or session's last ops as a Chrome/Perfetto trace).

Everything but the page takes an operator key (``--admin-key-file``; ``api/auth.Auth.admin``): 404 when the worker has
none, 401 without a valid key, 403 for a tenant's API key. The page asks for the key once, keeps it in the tab's
sessionStorage and sends it as the ``X-Admin-Key`` header (never in a URL); it is served from the worker's own origin,
so the browser guard (api/browser_safety.py) lets its requests through and nothing else changes for other pages.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from server_mock.api import endpoint as api_endpoint
from server_mock.api.auth import Auth
from server_mock.errors import WorkerError, not_found
from server_mock.operator.http_counts import CountAnswers
from server_mock.operator.state import console_state
from server_mock.service.metrics import CONTENT_TYPE

__all__ = ["operator_routes", "CountAnswers"]

PAGE = (Path(__file__).parent / "console.html").read_text(encoding="utf-8")
NO_STORE = {"cache-control": "no-store"}
# the page's own inline script and style, nothing from elsewhere; no framing, no referrer
PAGE_HEADERS = {**NO_STORE, "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; frame-ancestors 'none'; "
                "base-uri 'none'; form-action 'none'", "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


def _error(exc: WorkerError) -> Response:
    return JSONResponse({"error": {"code": exc.code, "message": exc.message}, "detail": exc.message},
                        status_code=exc.status, headers=NO_STORE)


def operator_routes(service, auth: Auth) -> list[Route]:
    def route(path: str, handler, public: bool = False) -> Route:
        return Route(path, api_endpoint.endpoint(handler, tenant_of=auth.admin, render_error=_error, public=public,
                                                 protocol="operator"), methods=["GET"])

    async def metrics(request: Request, admin: str) -> Response:
        # rendering takes milliseconds (benchmarks/metrics_cost.py): off the event loop, which serves the clients
        text = await asyncio.to_thread(service.usage.metrics.render)
        return Response(text, media_type=CONTENT_TYPE, headers=NO_STORE)

    async def page(request: Request, admin: str) -> Response:
        if not auth.has_admin:
            auth.admin(request)  # the 404 that says how to turn the operator's routes on
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)

    async def state(request: Request, admin: str) -> Response:
        return JSONResponse(console_state(service), headers=NO_STORE)

    async def scope_trace(request: Request, admin: str) -> Response:
        scope = request.path_params["scope"]
        return _trace(service, [scope], f"{scope} (last {service.usage.traces.per_scope} ops)", "op_scope", scope)

    async def session_trace(request: Request, admin: str) -> Response:
        session_id = request.path_params["session_id"]
        scopes = service.usage.traces.session_scopes(session_id)
        if scopes is None:
            raise not_found("session", session_id[:100])
        return _trace(service, scopes, f"session {session_id}", "session", session_id)

    return [
        route("/metrics", metrics),
        route("/console", page, public=True),
        route("/operator/state", state),
        route("/operator/traces/scope/{scope}", scope_trace),
        route("/operator/traces/session/{session_id}", session_trace),
    ]


def _trace(service, scopes: list[str], title: str, what: str, ident: str) -> Response:
    book = service.usage.traces
    records = book.records(scopes)
    if not records:
        raise WorkerError(404, f"{what}_not_traced", f"no finished ops are kept for {ident[:100]!r} (a run's or "
                                                     "sampler's id, or a session's)")
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in ident)[:80]
    return JSONResponse(book.trace(records, title),
                        headers={**NO_STORE, "content-disposition": f'attachment; filename="trace-{safe}.json"'})
