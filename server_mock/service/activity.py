"""What the operator's console shows that no other part keeps: each run's last op and when, each tenant's token
totals and recent errors, and what each model thread is running now.

Written from the model threads (service/usage.py) and by the endpoints (a refused request), read by the console's
JSON endpoint; every list is bounded (``ERRORS_KEPT`` errors per tenant, one entry per live scope, ``MAX_TENANTS``).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

ERRORS_KEPT = 20
MESSAGE_CHARS = 300
MAX_SCOPES = 4096
MAX_TENANTS = 4096
KINDS = ("train", "prefill", "generation")


@dataclass
class Running:
    """One model thread's current batch."""

    kind: str
    rows: int
    adapters: int
    tenants: list[str]
    tokens: int
    since: float  # wall clock
    open: set[str] = field(default_factory=set)  # its jobs not finished yet


class Activity:
    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._last_op: collections.OrderedDict[str, tuple[str, float, str]] = collections.OrderedDict()
        self._tokens: dict[str, dict[str, int]] = {}
        self._errors: dict[str, collections.deque[dict]] = {}
        self._running: dict[str, Running] = {}  # by model thread name

    def op_finished(self, scope: str, kind: str, status: str) -> None:
        with self._lock:
            self._last_op[scope] = (kind, self.clock(), status)
            self._last_op.move_to_end(scope)
            while len(self._last_op) > MAX_SCOPES:
                self._last_op.popitem(last=False)

    def last_op(self, scope: str) -> tuple[str, float, str] | None:
        with self._lock:
            return self._last_op.get(scope)

    def tokens(self, tenant: str, kind: str, count: int) -> None:
        with self._lock:
            totals = self._tokens.get(tenant)
            if totals is None:
                if len(self._tokens) >= MAX_TENANTS:
                    return
                totals = self._tokens[tenant] = dict.fromkeys(KINDS, 0)
            totals[kind] += count

    def error(self, tenant: str, op: str, status: int, code: str, message: str) -> None:
        with self._lock:
            ring = self._errors.get(tenant)
            if ring is None:
                if len(self._errors) >= MAX_TENANTS:
                    return
                ring = self._errors[tenant] = collections.deque(maxlen=ERRORS_KEPT)
            ring.append({"at": self.clock(), "op": op, "status": status, "code": code,
                         "message": message[:MESSAGE_CHARS]})

    def running(self, thread: str, batch: Running | None) -> None:
        with self._lock:
            if batch is None:
                self._running.pop(thread, None)
            else:
                self._running[thread] = batch

    def job_done(self, thread: str, request_id: str) -> None:
        with self._lock:
            batch = self._running.get(thread)
            if batch is not None:
                batch.open.discard(request_id)
                if not batch.open:
                    del self._running[thread]

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "tokens": {tenant: dict(totals) for tenant, totals in self._tokens.items()},
                "errors": {tenant: list(ring) for tenant, ring in self._errors.items()},
                "running": [{"thread": thread, "kind": b.kind, "rows": b.rows, "adapters": b.adapters,
                             "tenants": list(b.tenants), "tokens": b.tokens, "since": b.since}
                            for thread, b in self._running.items()],
            }
