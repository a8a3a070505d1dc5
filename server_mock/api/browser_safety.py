"""Keep web pages from driving the worker through the user's browser.

A page on any site can make the browser send requests to ``http://127.0.0.1:PORT``: as simple
cross-site POSTs (CSRF, which can only carry ``text/plain``, form or multipart bodies without a
preflight) or, after DNS rebinding, as same-origin requests to ``http://attacker.example:PORT``. A worker
without API keys would obey both. So:

* every body must declare its type: ``Content-Type: application/json`` for JSON (native, Tinker and
  OpenAI routes), ``application/x-protobuf`` for the Tinker ``forward_backward`` body
  (``require_media_type``). A page cannot send either cross-site without a CORS preflight, and the
  worker answers no preflight;
* the ``Host`` header must name this worker: a loopback address or ``localhost``, the address it is
  bound to (any IP address when bound to all interfaces), or a name given with ``--allowed-host``.
  A rebound name is none of these;
* a request with an ``Origin`` header (browsers add it; the SDK, the tinker and openai clients do
  not) must come from the worker's own origin or an ``--allowed-host`` name.
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server_mock.errors import WorkerError

JSON = "application/json"
WILDCARD_BINDS = {"0.0.0.0", "::", ""}


def require_media_type(request: Request, allowed: tuple[str, ...] = (JSON,), what: str = "this body") -> None:
    """415 unless the request's Content-Type (parameters such as charset ignored) is one of ``allowed``."""
    given = request.headers.get("content-type", "")
    media = given.split(";", 1)[0].strip().lower()
    if media not in allowed:
        want = " or ".join(allowed)
        raise WorkerError(415, "unsupported_media_type",
                          f"Content-Type: {what} must be sent as {want}, got {given or 'no Content-Type header'!r}",
                          "Content-Type")


class HostPolicy:
    """Which ``Host`` (and ``Origin``) names this worker answers to."""

    def __init__(self, bind_host: str = "127.0.0.1", allowed_hosts: list[str] | tuple[str, ...] = ()) -> None:
        self.bind = _normalise(bind_host)
        self.names = {_normalise(name) for name in allowed_hosts if name}
        self.any_host = "*" in self.names

    def host_allowed(self, host: str) -> bool:
        name = _normalise(_strip_port(host))
        if self.any_host or name in self.names or name == "localhost" or name == self.bind:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False  # a DNS name: only localhost and --allowed-host names
        return address.is_loopback or self.bind in WILDCARD_BINDS

    def origin_allowed(self, origin: str, host: str) -> bool:
        """Same origin as the request's Host, or a page on an ``--allowed-host`` name."""
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # includes "null" (sandboxed frames, file:// pages)
        if self.any_host or _normalise(parts.hostname) in self.names:
            return True
        return parts.netloc.lower() == host.lower() and self.host_allowed(host)


class BrowserGuard:
    """ASGI middleware: 403 for a foreign Host or Origin, before any route runs."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
                   if k.lower() in (b"host", b"origin")}
        host, origin = headers.get("host", ""), headers.get("origin")
        problem = None
        if host and not self.policy.host_allowed(host):
            problem = ("Host", f"Host: {host!r} is not a name this worker answers to (it answers to localhost, "
                               "loopback and its bind address); start it with --allowed-host NAME to accept it")
        elif origin is not None and not self.policy.origin_allowed(origin, host):
            problem = ("Origin", f"Origin: requests from web pages at {origin!r} are refused (a page must not drive "
                                 "the worker through a browser); start the worker with --allowed-host NAME to "
                                 "allow pages on NAME")
        if problem is None:
            await self.app(scope, receive, send)
            return
        field, message = problem
        body = json.dumps({"error": {"code": "forbidden_" + field.lower(), "message": message, "field": field},
                           "detail": message}).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _strip_port(host: str) -> str:
    host = host.strip()
    if host.startswith("["):  # [::1]:8000
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.rsplit(":", 1)[0]
    return host


def _normalise(name: str) -> str:
    name = name.strip().lower().rstrip(".")
    return name[1:-1] if name.startswith("[") and name.endswith("]") else name
