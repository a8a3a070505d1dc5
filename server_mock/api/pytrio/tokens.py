"""Actor tokens: the bearer credential of the Actor plane, minted by the worker for one run.

The SDK treats its ``actor_jwt.token`` as an opaque string and only reads ``expires_at`` (it renews through the
Control plane, with the API key, when 300 s or less are left, and once after a 401). So a token here is 256
random bits, not a JWT: unguessable, bound to one tenant and one run (training or sampling), expiring, renewable
(the same token gets a later expiry, so requests in flight with it keep working), and revoked when its run is
released. Tokens are looked up by their SHA-256, never compared as strings. They are not API keys: Actor routes
resolve their caller here, never through ``Auth.tenant``.

Only the SHA-256 is ever written down (``--durability full``, ``api/pytrio/durable.py``): a grant restored after a
restart opens its run for the token the SDK holds, and its first renewal mints a new token (the plain one is
unknown), while the old one keeps working until its own expiry.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from server_mock.errors import WorkerError

PREFIX = "pta_"  # "PyTRIO actor": tells a leaked token from an API key at a glance
MAX_TOKEN_CHARS = 512


@dataclass
class Grant:
    tenant: str
    kind: str  # "training" or "sampling"
    run_cuid: str
    session_cuid: str
    expires_at: float  # wall clock (time.time())


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class ActorTokens:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.time) -> None:
        self.ttl = ttl
        self.clock = clock
        self._grants: dict[bytes, Grant] = {}
        self._by_run: dict[str, tuple[str | None, bytes]] = {}  # run cuid -> (token, its digest); None: restored
        self._before: dict[str, bytes] = {}  # run cuid -> a restored token's digest, valid until it expires

    def __len__(self) -> int:
        return len(self._grants)

    def mint(self, tenant: str, kind: str, run_cuid: str, session_cuid: str) -> tuple[str, float]:
        """A new token for the run (any earlier one of the run is revoked) and its expiry."""
        self.revoke(run_cuid)
        token = PREFIX + secrets.token_urlsafe(32)
        digest = _digest(token)
        grant = Grant(tenant, kind, run_cuid, session_cuid, self.clock() + self.ttl)
        self._grants[digest] = grant
        self._by_run[run_cuid] = (token, digest)
        return token, grant.expires_at

    def renew(self, run_cuid: str) -> tuple[str, float]:
        """The run's token with a fresh expiry (a run restored after a restart gets a new token)."""
        held = self._by_run.get(run_cuid)
        if held is None:
            raise KeyError(run_cuid)
        token, digest = held
        grant = self._grants[digest]
        if token is None:  # restored: only its digest is known
            self._by_run.pop(run_cuid)
            self._before[run_cuid] = digest
            token = PREFIX + secrets.token_urlsafe(32)
            grant = Grant(grant.tenant, grant.kind, run_cuid, grant.session_cuid, 0.0)
            digest = _digest(token)
            self._grants[digest] = grant
            self._by_run[run_cuid] = (token, digest)
        grant.expires_at = self.clock() + self.ttl
        return token, grant.expires_at

    def revoke(self, run_cuid: str) -> None:
        held = self._by_run.pop(run_cuid, None)
        if held is not None:
            self._grants.pop(held[1], None)
        before = self._before.pop(run_cuid, None)
        if before is not None:
            self._grants.pop(before, None)

    def written(self, run_cuid: str) -> tuple[str, float] | None:
        """What is recorded of the run's current token: its digest (hex) and expiry."""
        held = self._by_run.get(run_cuid)
        if held is None:
            return None
        return held[1].hex(), self._grants[held[1]].expires_at

    def restore(self, digest_hex: str, grant: Grant) -> None:
        """A grant recorded before a restart (``written``), for the token the client still holds."""
        digest = bytes.fromhex(digest_hex)
        self._grants[digest] = grant
        self._by_run[grant.run_cuid] = (None, digest)

    def resolve(self, authorization: str | None) -> Grant:
        """The grant of ``Authorization: Bearer <token>``; 401 for a missing, unknown, revoked or expired token."""
        token = ""
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        if not token or len(token) > MAX_TOKEN_CHARS:
            raise WorkerError(401, "invalid_token", "Authorization: send the run's actor token as 'Bearer TOKEN' "
                                                    "(the Control plane hands it out; API keys are not accepted "
                                                    "here)", "Authorization")
        grant = self._grants.get(_digest(token))
        if grant is None:
            raise WorkerError(401, "invalid_token", "Authorization: unknown or revoked actor token (its run was "
                                                    "released, or the worker restarted)", "Authorization")
        if self.clock() >= grant.expires_at:
            raise WorkerError(401, "token_expired", "Authorization: the actor token has expired; renew it through "
                                                    "the Control plane", "Authorization")
        return grant
