"""API keys: each key is a tenant; every protocol resolves the caller's tenant here. Operator (admin) keys read the
worker's metrics, console and traces and are no tenant: they are refused on every tenant route (403), and a tenant
key is refused on the operator's routes (403)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from starlette.requests import Request

from server_mock.engine.fairness import parse_weight
from server_mock.errors import WorkerError

ADMIN_HEADER = "x-admin-key"  # the console sends the operator's key here (a bearer token works too)


def tenant_id(key: str) -> str:
    """The tenant a key stands for: stable, short, and not the key (``/v1/whoami`` answers it)."""
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def presented_key(headers: Mapping[str, str]) -> str:
    """The key a request carries: ``X-API-Key``, else a bearer token."""
    given = headers.get("x-api-key", "")
    auth = headers.get("authorization", "")
    if not given and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given


def _match(candidate: str, keys: list[bytes]) -> bytes | None:
    """The key equal to ``candidate``, compared in constant time against all (no early exit)."""
    given, match = candidate.encode(), None
    for key in keys:
        if hmac.compare_digest(given, key):
            match = key
    return match


class Auth:
    """API keys, each a tenant, and operator keys. Compared in constant time; with no API keys configured,
    everyone is one tenant (but an operator key is still refused on tenant routes)."""

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys if k]
        self._admin = [k.encode() for k in admin_keys if k]
        both = set(self._keys) & set(self._admin)
        if both:
            raise ValueError("a key is both an API key and an admin key: an operator key must not be a tenant")

    @property
    def has_admin(self) -> bool:
        return bool(self._admin)

    def tenant(self, request: Request) -> str:
        given = presented_key(request.headers)
        if self._admin and given and _match(given, self._admin) is not None:
            raise WorkerError(403, "admin_key_not_a_tenant", "this is an operator (admin) key: it reads /metrics, "
                                                             "the console and traces, and has no runs or samplers; "
                                                             "use an API key here")
        if not self._keys:
            return "default"
        match = _match(given, self._keys)
        if match is None:
            raise WorkerError(401, "unauthorized", "missing or invalid API key (send Authorization: Bearer KEY)")
        return tenant_id(match.decode())

    def admin(self, request: Request) -> str:
        """The operator's routes: 404 when no admin key is configured, 401 without a valid key, 403 for an API key.
        The key comes as ``X-Admin-Key`` or a bearer token."""
        if not self._admin:
            raise WorkerError(404, "not_found", f"{request.url.path}: the operator's routes are off; start the "
                                                "worker with --admin-key-file FILE (or PYTRIO_WORKER_ADMIN_KEYS)")
        given = request.headers.get(ADMIN_HEADER, "") or presented_key(request.headers)
        if given and _match(given, self._admin) is not None:
            return "admin"
        if given and _match(given, self._keys) is not None:
            raise WorkerError(403, "not_an_admin_key", "this API key is a tenant's: the operator's routes take an "
                                                       "admin key (--admin-key-file)")
        raise WorkerError(401, "unauthorized", "missing or invalid admin key (send X-Admin-Key: KEY or "
                                               "Authorization: Bearer KEY)")


def parse_key_lines(text: str, where: str, settings_allowed: bool = True) -> list[tuple[str, dict[str, float]]]:
    """A keys file: one key per line, ``#`` starts a comment, blank lines skipped; after the key, optional
    ``name=value`` settings separated by spaces (``tokens_per_minute=N``: this key's own token budget;
    ``weight=W``: its share of the model while several keys wait, engine/fairness.py). Raises ``ValueError``
    naming the line of a setting it does not know or a value out of bounds (never the key); without
    ``settings_allowed`` (an admin keys file: its keys are no tenants) any setting is refused."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        key, settings = fields[0], {}
        for item in fields[1:]:
            if not settings_allowed:
                raise ValueError(f"{where} line {number}: only a key may stand on a line of this file (settings "
                                 "such as tokens_per_minute=N and weight=W belong to API keys; a key holds no spaces)")
            name, sep, value = item.partition("=")
            if name == "weight" and sep:
                settings[name] = parse_weight(value, f"{where} line {number}")
                continue
            if name not in KEY_SETTINGS or not sep or not value.isdigit():  # not echoed: it may be part of a key
                raise ValueError(f"{where} line {number}: after the key, only {', '.join(KEY_SETTINGS)}=N and "
                                 "weight=W settings may follow, separated by spaces (a key holds no spaces)")
            settings[name] = int(value)
        out.append((key, settings))
    return out


KEY_SETTINGS = ("tokens_per_minute",)  # integer settings; ``weight`` is a number (engine/fairness.py)
