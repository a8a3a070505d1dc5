"""Client sessions: a client's lease on service objects (its training runs and samplers), kept alive by its
requests and heartbeats, bounded per API key, and finished by the clock once idle.

Each front end keeps its own session type (its ids and extra fields: Tinker's creations and labels, PyTRIO's
status and SDK version) and what closing one releases, in its own order (PyTRIO: the adapter first, then the
record). This is the one place for the per-key cap, the lookup that checks the tenant and marks the session
seen, and which sessions are idle past their TTL. A session is any object with ``tenant``, ``created`` and
``last_seen``; the collection reads like a dict of them by id, so a restart can put them back as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from server_mock.errors import WorkerError

S = TypeVar("S")


class ClientSessions(Generic[S]):
    """The open sessions of one protocol, by id. ``cap`` per API key (past it, 429 ``too_many_sessions`` naming
    ``cap_flag``; a front end's renderer may map it to its wire), ``ttl`` seconds without being seen before
    ``idle`` names it; ``missing(id)`` is the error of a lookup that finds no session of the caller's."""

    def __init__(self, cap: int, ttl: float, clock: Callable[[], float], missing: Callable[[str], WorkerError], *,
                 cap_flag: str, ttl_flag: str, noun: str = "sessions", advice: str = "close some") -> None:
        self.cap, self.ttl, self.clock, self.missing = cap, ttl, clock, missing
        self.cap_flag, self.ttl_flag, self.noun, self.advice = cap_flag, ttl_flag, noun, advice
        self._open: dict[str, S] = {}

    def check_room(self, tenant: str) -> None:
        """429 when this API key already has ``cap`` open sessions."""
        owned = sum(1 for s in self._open.values() if s.tenant == tenant)
        if owned >= self.cap:
            raise WorkerError(429, "too_many_sessions",
                              f"this API key has {owned} open {self.noun} (limit {self.cap_flag}={self.cap}); "
                              f"{self.advice}, or wait for idle ones to close after {self.ttl_flag}={self.ttl:g} s")

    def open(self, session_id: str, session: S, record: Callable[[S], Any] | None = None) -> S:
        """Add a new session if its key has room; ``record(session)`` (its journal record) runs first, so a
        failed write adds nothing."""
        self.check_room(session.tenant)
        if record is not None:
            record(session)
        self._open[session_id] = session
        return session

    def lookup(self, session_id: str | None, tenant: str) -> S:
        """The caller's session, marked seen now; ``missing`` when it is unknown or another key's."""
        session = self._open.get(session_id) if session_id is not None else None
        if session is None or session.tenant != tenant:
            raise self.missing(session_id or "")
        session.last_seen = self.clock()
        return session

    def of(self, tenant: str) -> list[S]:
        """This key's open sessions, oldest first."""
        return sorted((s for s in self._open.values() if s.tenant == tenant), key=lambda s: s.created)

    def idle(self, now: float | None = None) -> list[S]:
        """The sessions not seen for more than ``ttl`` seconds: to be closed."""
        now = self.clock() if now is None else now
        return [s for s in self._open.values() if now - s.last_seen > self.ttl]

    # a dict of sessions by id, for the front ends' own bookkeeping and their restart
    def get(self, session_id: str, default: S | None = None) -> S | None:
        return self._open.get(session_id, default)

    def pop(self, session_id: str, default: S | None = None) -> S | None:
        return self._open.pop(session_id, default)

    def __setitem__(self, session_id: str, session: S) -> None:
        self._open[session_id] = session

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._open

    def __iter__(self) -> Iterator[str]:
        return iter(self._open)

    def __len__(self) -> int:
        return len(self._open)

    def values(self):
        return self._open.values()

    def items(self):
        return self._open.items()
