"""Bytes of request bodies being received, per tenant and on the whole worker.

A body is counted from the moment its headers arrive: its declared ``Content-Length`` at once (a count, nothing
is allocated for it), or, without one (chunked), its bytes as they come. What it counts is given back once the
body has been read (or refused). A body that would take a tenant past ``--max-body-bytes-in-flight-per-tenant``,
or the worker past ``--max-body-bytes-in-flight``, is answered 429 with Retry-After before any more of it is
read: a client that announces bodies it never sends holds only its own share, and no memory.
"""

from __future__ import annotations

from server_mock.errors import WorkerError

TENANT_SCOPE_KEY = "server_mock.tenant"  # the request's tenant, set where it is authenticated
OVER_BUDGET = "body_budget_exceeded"  # a 429 that passes once other bodies are in: every protocol's "try again"


class BodyBudget:
    """Body bytes in flight: ``held`` on the worker, ``by_tenant``; each body holds a ``BodyHold``."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = max(1, total)
        self.per_tenant = max(1, per_tenant)
        self.held = 0
        self.by_tenant: dict[str, int] = {}
        self.refused = 0

    def hold(self, tenant: str) -> BodyHold:
        return BodyHold(self, tenant)

    def _take(self, tenant: str, extra: int, size: int) -> None:
        mine = self.by_tenant.get(tenant, 0)
        if mine + extra > self.per_tenant:
            self.refused += 1
            raise WorkerError(429, OVER_BUDGET,
                              f"body: this API key's request bodies being received hold {mine} bytes; this one "
                              f"({size} bytes) would pass the limit max_body_bytes_in_flight_per_tenant="
                              f"{self.per_tenant} (--max-body-bytes-in-flight-per-tenant); retry once the others "
                              "are sent", "body")
        if self.held + extra > self.total:
            self.refused += 1
            raise WorkerError(429, OVER_BUDGET,
                              f"body: request bodies being received hold {self.held} bytes on this worker; this one "
                              f"({size} bytes) would pass the limit max_body_bytes_in_flight={self.total} "
                              "(--max-body-bytes-in-flight); retry shortly", "body")
        self.by_tenant[tenant] = mine + extra
        self.held += extra

    def _give(self, tenant: str, size: int) -> None:
        left = self.by_tenant.get(tenant, 0) - size
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)
        self.held = max(0, self.held - size)


class BodyHold:
    """What one body holds of a ``BodyBudget``: grown to the body's size as it is known, released once."""

    def __init__(self, budget: BodyBudget, tenant: str) -> None:
        self.budget, self.tenant, self.size = budget, tenant, 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all (429 naming the limit if that is past one; nothing changes then)."""
        if size > self.size:
            self.budget._take(self.tenant, size - self.size, size)
            self.size = size

    def release(self) -> None:
        if self.size:
            self.budget._give(self.tenant, self.size)
            self.size = 0
