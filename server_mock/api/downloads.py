"""Signed download URLs, and the one route that serves them, for every protocol.

A client downloads weights in two steps: an authenticated call of its protocol asks for a URL, then a plain
``GET`` of that URL fetches the file. Several clients send no credentials on the second step (the official
PyTRIO SDK, Tinker's CLI and cookbook, which use ``urllib``), so the URL carries its own authority: an
HMAC-SHA256, under a key the worker draws when it starts, of what it serves, to whom, and until when. A URL is
only ever made inside the owner's authenticated call, so it is as good as the owner's word for that one file.

Interface (for the protocol packages; the app makes one ``Downloads`` and keeps it in ``app.state.downloads``)::

    url, expires_at = await downloads.url_for(request, service, ref, tenant, ttl=None)
        service  a name given to ``register``; built in: "checkpoint-archive", where ref is a trio:// path
                 (or a checkpoint id) of a saved state/sampler checkpoint, served as the tar of its adapter
                 folder (storage/archive.py, built now if it is not cached yet)
        ref      what the service's resolver finds the file by
        tenant   the caller's tenant: the file must still be theirs when it is fetched
        ttl      seconds the URL stays valid (default: --download-url-seconds)
        returns  an absolute URL on the base the client used (``request.base_url``) and its expiry (UTC)
    downloads.register(service, resolver)
        resolver(ref, tenant) -> Served(path, filename, version), run in a worker thread; it raises a
        ``WorkerError`` (404 for something that is not the tenant's) when there is nothing to serve

The route, ``GET|HEAD /downloads/{token}/{filename}``, needs no API key. It answers 403 for a URL that was
altered or has expired (clients then ask for a new one), 404 when the file is gone, was overwritten since the
URL was made (a resumed download must not mix two versions), is not the URL's tenant's, or the request
carries the API key of another tenant. The file is streamed from disk with ``Content-Length``; ``Range``
requests get 206 with ``Content-Range``, a range starting at the end of the file 416 with
``Content-Range: bytes */<size>`` (how a client learns its copy is complete), and no ``Range`` 200.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from pytrio_compat.wire import ErrorBody, ErrorResponse
from server_mock.errors import WorkerError

ARCHIVE = "checkpoint-archive"
MAX_TTL_SECONDS = 7 * 24 * 3600


@dataclass(frozen=True)
class Served:
    path: Path  # the file on disk
    filename: str  # the name a client saves it under
    version: str  # changes whenever the file's content may have changed


Resolver = Callable[[str, str], Served]


class Downloads:
    def __init__(self, default_ttl: float = 3600.0, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)  # per worker process: a restart invalidates every URL
        self.default_ttl = default_ttl
        self._resolvers: dict[str, Resolver] = {}
        self._callers: list[Callable[[Request], str]] = []

    def register(self, service: str, resolver: Resolver) -> None:
        self._resolvers[service] = resolver

    def recognize(self, tenant_of: Callable[[Request], str]) -> None:
        """Another way a protocol reads the caller's API key (Tinker's ``tml-`` prefix): a download carrying
        another tenant's key in that form is refused too."""
        self._callers.append(tenant_of)

    async def url_for(self, request: Request, service: str, ref: str, tenant: str,
                      ttl: float | None = None) -> tuple[str, datetime]:
        ttl = self.default_ttl if ttl is None else ttl
        if not 0 < ttl <= MAX_TTL_SECONDS:
            raise WorkerError(400, "invalid_ttl", f"ttl: a download URL lives 1 s to {MAX_TTL_SECONDS} s, got {ttl}")
        served = await asyncio.to_thread(self._resolvers[service], ref, tenant)
        expires = int(time.time() + ttl)
        payload = _b64(json.dumps([service, ref, tenant, expires, served.version], separators=(",", ":")).encode())
        token = f"{payload}.{self._sign(payload)}"
        base = str(request.base_url).rstrip("/")
        return (f"{base}/downloads/{token}/{quote(served.filename, safe='')}",
                datetime.fromtimestamp(expires, tz=timezone.utc))

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())

    def _open(self, token: str) -> tuple[str, str, str, int, str]:
        payload, _, signature = token.partition(".")
        if not signature or not hmac.compare_digest(signature, self._sign(payload)):
            raise WorkerError(403, "invalid_download_url", "this download URL is not one this worker signed (it was "
                                                           "altered, or the worker restarted since): ask for a new one")
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        service, ref, tenant, expires, version = json.loads(raw)
        if time.time() > expires:
            when = datetime.fromtimestamp(expires, tz=timezone.utc).isoformat()
            raise WorkerError(403, "download_url_expired", f"this download URL expired at {when}: ask for a new one")
        return service, ref, tenant, expires, version

    async def serve(self, request: Request) -> Response:
        try:
            service, ref, tenant, _, version = self._open(request.path_params["token"])
            caller = self._caller(request)
            if caller is not None and caller != tenant:
                raise _not_found()
            resolver = self._resolvers.get(service)
            if resolver is None:
                raise _not_found()
            served = await asyncio.to_thread(resolver, ref, tenant)
            if served.version != version:
                raise WorkerError(404, "download_changed", "the file changed since this download URL was made (the "
                                                           "checkpoint was overwritten): ask for a new URL")
            stat = os.stat(served.path)
        except FileNotFoundError:
            return _error(_not_found())
        except WorkerError as exc:
            return _error(exc)
        return FileResponse(served.path, media_type="application/octet-stream", filename=served.filename,
                            stat_result=stat,
                            headers={"etag": f'"{served.version}"', "cache-control": "private, no-store"})

    def _caller(self, request: Request) -> str | None:
        """The tenant of the API key the request carries, if it carries a valid one (a URL needs none)."""
        if not any(h in request.headers for h in ("x-api-key", "authorization")):
            return None
        for tenant_of in (request.app.state.auth.tenant, *self._callers):
            try:
                return tenant_of(request)
            except WorkerError:
                continue
        return None

    def routes(self) -> list[Route]:
        async def download(request: Request) -> Response:
            return await self.serve(request)

        return [Route("/downloads/{token}/{filename}", download, methods=["GET", "HEAD"])]


def archive_resolver(checkpoints) -> Resolver:
    """The built-in "checkpoint-archive" service over the worker's ``service.checkpoints``."""

    def resolve(ref: str, tenant: str) -> Served:
        checkpoint, path, version = checkpoints.archive(ref, tenant)
        return Served(path, f"{checkpoint.run_id}-{checkpoint.kind}-{checkpoint.name}.tar", version)

    return resolve




def _not_found() -> WorkerError:
    return WorkerError(404, "not_found", "nothing to download at this URL")


def _error(exc: WorkerError) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message, field=exc.field))
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")
