"""API keys: each key is a tenant; every protocol resolves the caller's tenant here."""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from server_mock.errors import WorkerError


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
