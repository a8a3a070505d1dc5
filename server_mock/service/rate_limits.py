"""Per-key token budgets per minute (``--tokens-per-minute``, or per key in the keys file): what a key may spend on
the model, refused with 429 and a ``Retry-After`` that says when it may.

Each key has a bucket that holds at most its budget and refills at budget / 60 tokens a second. A request is charged
when it is accepted, before anything changes: a forward op its datums' tokens (exact), a sample request its prompt
plus ``num_samples x max_tokens`` (what it may cost at most); when a sample ends, what it did not use comes back
(``settle``), and so does everything a request that failed on the model was charged. A request is accepted while the
bucket holds its cost; one that costs more than the whole budget is accepted when the bucket is full (and empties
it), so that no request is refused for ever. Requests that cost nothing (optimizer steps, saves) always pass.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable

from server_mock.errors import WorkerError

WINDOW_SECONDS = 60.0
READY_POLL_SECONDS = 1.0  # a waiting request looks again this often (refunds may make room sooner)


class RateLimited(WorkerError):
    """429 with the seconds until the request fits (``retry_after``, rounded up for the ``Retry-After`` header;
    ``wait``, exact), and the tokens it costs (a front end that holds the request instead waits for those)."""

    def __init__(self, message: str, retry_after: int, wait: float = 0.0, tokens: int = 0) -> None:
        super().__init__(429, "rate_limited", message, "tokens_per_minute")
        self.retry_after = retry_after
        self.wait = wait
        self.tokens = tokens


class TokenBudgets:
    """Token buckets by tenant: ``per_minute`` for every tenant (0: no limit) unless ``set`` gave it its own."""

    def __init__(self, per_minute: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self.on_limited: Callable[[str], None] | None = None  # told the tenant of each refusal or wait
        self._own: dict[str, int] = {}
        self._level: dict[str, tuple[float, float]] = {}  # tenant -> (tokens in the bucket, when measured)
        self._lock = threading.Lock()  # refunds come from the model threads

    def set(self, tenant: str, per_minute: int) -> None:
        """This tenant's own budget (0: no limit for it)."""
        self._own[tenant] = per_minute

    def budget(self, tenant: str) -> int:
        return self._own.get(tenant, self.per_minute)

    def _now_level(self, tenant: str, budget: int, now: float) -> float:
        level, at = self._level.get(tenant, (float(budget), now))
        return min(float(budget), level + (now - at) * budget / WINDOW_SECONDS)

    def left(self, tenant: str) -> float | None:
        """Tokens this tenant may use now (None: no budget)."""
        budget = self.budget(tenant)
        if budget <= 0:
            return None
        with self._lock:
            return self._now_level(tenant, budget, self.clock())

    def wait_seconds(self, tenant: str, tokens: int) -> float:
        """How long until a request of ``tokens`` fits (0: now)."""
        budget = self.budget(tenant)
        if budget <= 0 or tokens <= 0:
            return 0.0
        with self._lock:
            level = self._now_level(tenant, budget, self.clock())
        missing = min(tokens, budget) - level
        return max(0.0, missing * WINDOW_SECONDS / budget)

    def take(self, tenant: str, tokens: int) -> None:
        """Charge ``tokens`` to ``tenant`` now, or raise ``RateLimited`` (nothing charged)."""
        budget = self.budget(tenant)
        if budget <= 0 or tokens <= 0:
            return
        with self._lock:
            now = self.clock()
            level = self._now_level(tenant, budget, now)
            need = min(tokens, budget)
            if level < need:
                wait = (need - level) * WINDOW_SECONDS / budget
                self._limited(tenant)
                raise RateLimited(
                    f"tokens_per_minute: this API key may use {budget} tokens a minute; this request needs "
                    f"{tokens} and {int(level)} are left now; retry in {wait:.1f} s (Retry-After)",
                    max(1, math.ceil(wait)), wait, tokens)
            self._level[tenant] = (level - tokens, now)

    def give_back(self, tenant: str, tokens: int) -> None:
        """Return ``tokens`` charged but not used (a sample's unused max_tokens, a request that failed)."""
        budget = self.budget(tenant)
        if budget <= 0 or tokens <= 0:
            return
        with self._lock:
            now = self.clock()
            self._level[tenant] = (min(float(budget), self._now_level(tenant, budget, now) + tokens), now)

    async def ready(self, tenant: str, tokens: int) -> None:
        """Wait until a request of ``tokens`` fits (for a protocol whose client cannot retry a refusal: the request
        waits instead); a ``take`` right after, with no await between, then succeeds."""
        if self.wait_seconds(tenant, tokens) > 0:
            self._limited(tenant)
        while (wait := self.wait_seconds(tenant, tokens)) > 0:
            await asyncio.sleep(min(wait, READY_POLL_SECONDS))

    def _limited(self, tenant: str) -> None:
        if self.on_limited is not None:
            self.on_limited(tenant)
