"""Client sessions: a client's lease on service objects (its training runs and samplers), kept alive by its
requests and heartbeats, bounded per API key, and finished by the clock once idle.

Each front end keeps its own session type (its ids and extra fields: Tinker's creation count and labels, PyTRIO's
status and SDK version) and how each object a closed session held is released, in its own order (PyTRIO: the
adapter first, then the record). This is the one place for the per-key cap, the lookup that checks the tenant and
marks the session seen, which sessions are idle past their TTL, and what each session leased: objects of a kind
(a front end's names: ``"training"``, ``"sampler"``, ...) by id, each with an optional value, oldest first.
Closing a session hands back its leases, so "what does this session hold" is answered here only.

A session is any object with ``tenant``, ``created`` and ``last_seen``; the collection reads like a dict of them by
id, so a restart can put them back as they were, and then lease again what its records say each one held.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from server_mock.errors import WorkerError

S = TypeVar("S")

Leases = dict[str, dict[Hashable, Any]]  # kind -> object id -> its value, oldest first
_NONE: Mapping[Hashable, Any] = MappingProxyType({})


class ClientSessions(Generic[S]):
    """The open sessions of one protocol, by id. ``cap`` per API key (past it, 429 ``too_many_sessions`` naming
    ``cap_flag``; a front end's renderer may map it to its wire), ``ttl`` seconds without being seen before
    ``idle`` names it; ``missing(id)`` is the error of a lookup that finds no session of the caller's.

    An object id names one object of its kind: ``holder`` tells which open session leased it last."""

    def __init__(self, cap: int, ttl: float, clock: Callable[[], float], missing: Callable[[str], WorkerError], *,
                 cap_flag: str, ttl_flag: str, noun: str = "sessions", advice: str = "close some") -> None:
        self.cap, self.ttl, self.clock, self.missing = cap, ttl, clock, missing
        self.cap_flag, self.ttl_flag, self.noun, self.advice = cap_flag, ttl_flag, noun, advice
        self._open: dict[str, S] = {}
        self._leases: dict[str, Leases] = {}
        self._holders: dict[tuple[str, Hashable], str] = {}  # (kind, object id) -> the session that leased it

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

    # -- leases ----------------------------------------------------------------------------------------------

    def lease(self, session_id: str, kind: str, object_id: Hashable, value: Any = None) -> bool:
        """``session_id`` holds ``object_id`` (a ``kind`` of the front end's), with ``value``; False, and nothing
        leased, when that session is not open (it closed while the object was made). Leasing an id the session
        holds already sets its value and keeps its place."""
        if session_id not in self._open:
            return False
        self._leases.setdefault(session_id, {}).setdefault(kind, {})[object_id] = value
        self._holders[(kind, object_id)] = session_id
        return True

    def release(self, session_id: str, kind: str, object_id: Hashable) -> bool:
        """The session no longer holds the object; False when it did not."""
        held = self._leases.get(session_id, {}).get(kind)
        if held is None or object_id not in held:
            return False
        del held[object_id]
        if self._holders.get((kind, object_id)) == session_id:
            del self._holders[(kind, object_id)]
        return True

    def leases(self, session_id: str, kind: str) -> Mapping[Hashable, Any]:
        """What the session holds of ``kind``: object id -> value, oldest first (empty for a session not open).
        A live view: copy it (``list(...)``) to release while going through it."""
        held = self._leases.get(session_id, {}).get(kind)
        return _NONE if held is None else MappingProxyType(held)

    def holder(self, kind: str, object_id: Hashable) -> str | None:
        """The open session that leased the object, None if none holds it."""
        return self._holders.get((kind, object_id))

    def close(self, session_id: str) -> Leases:
        """Remove the session and hand back everything it leased (empty when it was not open), for the front end
        to release in its own order; its leases end here, so releasing one of them afterwards is a no-op."""
        self._open.pop(session_id, None)
        leases = self._leases.pop(session_id, {})
        for kind, held in leases.items():
            for object_id in held:
                if self._holders.get((kind, object_id)) == session_id:
                    del self._holders[(kind, object_id)]
        return leases

    # a dict of sessions by id, for the front ends' own bookkeeping and their restart
    def get(self, session_id: str, default: S | None = None) -> S | None:
        return self._open.get(session_id, default)

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
