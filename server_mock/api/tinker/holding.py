"""What requests waiting for an earlier seq_id may keep: ``HeldBytes`` counts their bytes per session
and on the whole worker, and ``Slim`` is the smaller form a request keeps while it waits."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from server_mock.errors import WorkerError


class HeldBytes:
    """Bytes kept by requests waiting for an earlier seq_id: per session and on the whole worker."""

    def __init__(self, per_session: int, per_worker: int) -> None:
        self.per_session = per_session
        self.per_worker = per_worker
        self.total = 0
        self.by_session: dict[str, int] = {}

    def reserve(self, session: str, size: int) -> None:
        held = self.by_session.get(session, 0)
        if held + size > self.per_session:
            raise WorkerError(429, "too_many_waiting_bytes",
                              f"seq_id: requests of this session waiting for an earlier seq_id hold {held} bytes; "
                              f"this one ({size} bytes) would pass the limit max_waiting_bytes_per_session="
                              f"{self.per_session}; send the earlier seq_ids first, or retry shortly", "seq_id")
        if self.total + size > self.per_worker:
            raise WorkerError(429, "too_many_waiting_bytes",
                              f"seq_id: requests waiting for an earlier seq_id hold {self.total} bytes on this "
                              f"worker; this one ({size} bytes) would pass the limit max_waiting_bytes_per_worker="
                              f"{self.per_worker}; retry shortly", "seq_id")
        self.by_session[session] = held + size
        self.total += size

    def release(self, session: str, size: int) -> None:
        left = self.by_session.get(session, 0) - size
        if left > 0:
            self.by_session[session] = left
        else:
            self.by_session.pop(session, None)
        self.total = max(0, self.total - size)


@dataclass
class Slim:
    """A smaller form for a request to keep while it waits: ``size`` bytes, and ``prepare()`` (run in a
    thread when the request's turn comes) gives back its ``submit`` callable."""

    size: int
    prepare: Callable[[], Callable[[], Awaitable[Any]]]
