"""Bytes of PyTRIO answers kept for polls and retries, per API key: the finished events' answers of its training
runs and the remembered answers of its sampling runs, together within ``--max-result-bytes`` (as the native
requests' and Tinker futures' results are). Past it the key's oldest kept answer is forgotten first; the newest
always stays, so that it can be fetched. A forgotten event answers 404 to a poll, and a forgotten sample request
is sampled again when it is retried."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class KeptAnswers:
    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._held: dict[str, OrderedDict[Hashable, tuple[int, Callable[[], None]]]] = {}
        self._bytes: dict[str, int] = {}
        self.dropped = 0  # answers forgotten for the budget

    def held_bytes(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def keep(self, tenant: str, key: Hashable, size: int, forget: Callable[[], None]) -> None:
        """Count an answer of ``size`` bytes; ``forget()`` drops it where it is kept, when the budget needs room."""
        self.drop(tenant, key)
        held = self._held.setdefault(tenant, OrderedDict())
        held[key] = (size, forget)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        while self._bytes[tenant] > self.limit and len(held) > 1:
            _, (old_size, old_forget) = held.popitem(last=False)
            self._bytes[tenant] -= old_size
            self.dropped += 1
            old_forget()

    def drop(self, tenant: str, key: Hashable) -> None:
        """An answer forgotten for another reason (its TTL, its run's own bounds, its run released)."""
        held = self._held.get(tenant)
        if held is None or key not in held:
            return
        size, _ = held.pop(key)
        self._bytes[tenant] -= size
        if not held:
            del self._held[tenant]
            del self._bytes[tenant]
