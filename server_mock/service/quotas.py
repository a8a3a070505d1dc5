"""Per-tenant quotas: each API key gets its own share of the worker's caches and queue.

One tenant's volume never evicts, expires or refuses another tenant's things: a cache over its quota
drops the same tenant's least recently used entry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

from server_mock.engine.requests import RequestStore
from server_mock.errors import WorkerError

V = TypeVar("V")


class TenantLRU(Generic[V]):
    """``key -> value``, each owned by a tenant; at most ``per_tenant`` entries per tenant.

    Thread-safe: model threads add snapshots they load while the event loop reads.
    """

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = max(1, per_tenant)
        self._owner: dict[str, str] = {}
        self._by_tenant: dict[str, OrderedDict[str, V]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, tenant: str, value: V) -> list[str]:
        """Add (or refresh) ``key``; returns the keys of this tenant's entries evicted to make room."""
        with self._lock:
            self._pop(key)
            entries = self._by_tenant.setdefault(tenant, OrderedDict())
            entries[key] = value
            self._owner[key] = tenant
            evicted = []
            while len(entries) > self.per_tenant:
                old, _ = entries.popitem(last=False)
                del self._owner[old]
                evicted.append(old)
            return evicted

    def get(self, key: str) -> V | None:
        """The value, marked as recently used; None if absent."""
        with self._lock:
            tenant = self._owner.get(key)
            if tenant is None:
                return None
            entries = self._by_tenant[tenant]
            entries.move_to_end(key)
            return entries[key]

    def owner(self, key: str) -> str | None:
        with self._lock:
            return self._owner.get(key)

    def pop(self, key: str) -> V | None:
        with self._lock:
            return self._pop(key)

    def count(self, tenant: str) -> int:
        with self._lock:
            return len(self._by_tenant.get(tenant, ()))

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._owner

    def __len__(self) -> int:
        with self._lock:
            return len(self._owner)

    def _pop(self, key: str) -> V | None:
        tenant = self._owner.pop(key, None)
        if tenant is None:
            return None
        entries = self._by_tenant[tenant]
        value = entries.pop(key)
        if not entries:
            del self._by_tenant[tenant]
        return value


def check_queued(requests: RequestStore, tenant: str, limit: int) -> None:
    """429 when this tenant already has ``limit`` requests queued or running (others are unaffected)."""
    if requests.unfinished(tenant) >= limit:
        raise WorkerError(429, "too_many_queued_requests",
                          f"limit max_queued_requests={limit} reached: this API key has {limit} requests queued "
                          "or running; retry when some finish (or raise --max-queued-requests)")


class ByteBudget:
    """Bytes held by each tenant's things and by all of them together, within a limit for each (a ``take`` that
    would pass one is refused with 429 naming it, and changes nothing).

    Shared things (``take_shared``: the adapter pools' resident sampler adapters) count only toward the total.
    They are a cache: a ``take`` that the total refuses first asks each of ``reclaimers`` (``reclaim(bytes) ->
    bytes freed``) to free what is missing, where the shared bytes could cover it (otherwise it is refused and the
    caches are kept). Thread-safe: model threads charge their pools."""

    def __init__(self, per_tenant: int, total: int, what: str, per_tenant_name: str, total_name: str) -> None:
        self.per_tenant, self.total = per_tenant, total
        self.what, self.per_tenant_name, self.total_name = what, per_tenant_name, total_name
        self.by_tenant: dict[str, int] = {}
        self.held = 0
        self.shared = 0  # of ``held``: the bytes of take_shared
        self.reclaimers: list[Callable[[int], int]] = []
        self._items: dict[str, tuple[str | None, int]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, tenant: str, size: int, needs: str) -> None:
        """Charge ``size`` bytes for ``key`` to ``tenant`` (``needs``: what they are, for the message)."""
        with self._lock:
            missing = self._check(tenant, size, needs)
            if missing > self.shared:  # more than the pools could free: refused as it is, the pools kept
                self._check(tenant, size, needs, refuse=True)
        if missing > 0 and self.reclaimers:  # outside the lock: a pool gives its bytes back through give_back
            for reclaim in self.reclaimers:
                missing -= reclaim(missing)
                if missing <= 0:
                    break
        with self._lock:
            if self._check(tenant, size, needs, refuse=True) == 0:
                self._add(key, tenant, size)

    def room(self) -> int:
        """The bytes the worker's total can still hold."""
        with self._lock:
            return self.total - self.held

    def take_shared(self, key: str, size: int, needs: str) -> None:
        """Charge ``size`` bytes for ``key`` to the worker's total only (no tenant's share)."""
        with self._lock:
            if self.held + size > self.total:
                raise self._over_total(size, needs)
            self._add(key, None, size)

    def _check(self, tenant: str, size: int, needs: str, refuse: bool = False) -> int:
        """Raise if ``tenant``'s share cannot hold ``size`` more bytes; the bytes the total lacks (with
        ``refuse``: raise instead)."""
        mine = self.by_tenant.get(tenant, 0)
        if mine + size > self.per_tenant:
            raise WorkerError(429, "memory_budget_exceeded",
                              f"{self.what}: {needs} needs {size} bytes; this API key's {self.what}s hold {mine} of "
                              f"its limit {self.per_tenant_name}={self.per_tenant}; delete some or ask for less",
                              self.what)
        missing = self.held + size - self.total
        if missing > 0 and refuse:
            raise self._over_total(size, needs)
        return max(0, missing)

    def _over_total(self, size: int, needs: str) -> WorkerError:
        """The refusal of ``size`` bytes that the worker's total cannot hold (tenants' things and shared ones)."""
        shared = f", {self.shared} of them resident sampler adapters" if self.shared else ""
        return WorkerError(429, "memory_budget_exceeded",
                           f"{self.what}: {needs} needs {size} bytes; all API keys together hold {self.held}"
                           f"{shared}, of the worker's limit {self.total_name}={self.total} "
                           f"(--{self.total_name.replace('_', '-')}); retry later", self.what)

    def _add(self, key: str, tenant: str | None, size: int) -> None:
        self._items[key] = (tenant, size)
        self.held += size
        if tenant is None:
            self.shared += size
        else:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + size

    def give_back(self, key: str) -> None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return
            tenant, size = item
            self.held -= size
            if tenant is None:
                self.shared -= size
                return
            left = self.by_tenant.get(tenant, 0) - size
            if left > 0:
                self.by_tenant[tenant] = left
            else:
                self.by_tenant.pop(tenant, None)


class PoolCharge:
    """A model's adapter pool (engine/adapter_pool.py) charged to the worker's adapter ``ByteBudget``: each
    resident entry's bytes count toward --max-adapter-bytes-total while it stays in the pool."""

    def __init__(self, budget: ByteBudget, model: str) -> None:
        self.budget, self.model = budget, model

    def charge(self, key: str, size: int) -> None:
        self.budget.take_shared(f"pool\x00{self.model}\x00{key}", size,
                                f"sampler adapter {key} on {self.model} (its adapter pool entry)")

    def release(self, key: str) -> None:
        self.budget.give_back(f"pool\x00{self.model}\x00{key}")

    def room(self) -> int:
        return self.budget.room()

    @property
    def total(self) -> int:
        return self.budget.total
