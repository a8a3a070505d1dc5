"""Long polls held open, per tenant: Tinker ``retrieve_future``, native ``GET /v1/requests/{id}?wait=``, PyTRIO
``GET /pytrio-actor/v1/events/{id}`` with ``Prefer: wait=``.

A held poll is a complete request on an open connection: the connection guard (server_mock/connections.py)
cannot close it to make room, so polls alone could fill ``--max-connections`` and shut every other client out.
Two bounds stop that, and both end a poll the way its protocol ends one that ran out of time ("not ready yet,
poll again": Tinker's ``try_again``, the request's or event's current status), never by refusing a connection:

- a tenant holds at most ``--max-long-polls-per-tenant`` polls; its next one ends its oldest at once;
- when the guard finds no connection it may close, it asks ``relieve``: the oldest poll of the connection's own
  address (its per-address cap), or of the tenant holding the most polls (the worker's cap), ends, and its
  connection becomes idle, hence closable.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable

from starlette.requests import Request


class _Poll:
    __slots__ = ("tenant", "peer", "cut")

    def __init__(self, tenant: str, peer: str) -> None:
        self.tenant, self.peer, self.cut = tenant, peer, asyncio.Event()


class LongPolls:
    """The polls held now, oldest first per tenant; ``ended_early`` counts those cut short."""

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = max(1, per_tenant)
        self._held: dict[str, OrderedDict[_Poll, None]] = {}
        self.ended_early = 0

    def held(self, tenant: str) -> int:
        return len(self._held.get(tenant, ()))

    async def hold(self, tenant: str, peer: str, wait: Awaitable) -> bool:
        """Await ``wait`` as a held poll of ``tenant``; False if it was ended early (``wait`` is then cancelled:
        it must be a wait only, never the work itself)."""
        mine = self._held.setdefault(tenant, OrderedDict())
        while len(mine) >= self.per_tenant:
            self._end(next(iter(mine)))
        poll = _Poll(tenant, peer)
        mine[poll] = None
        waiter, cutter = asyncio.ensure_future(wait), asyncio.ensure_future(poll.cut.wait())
        try:
            await asyncio.wait({waiter, cutter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            cutter.cancel()
            self._forget(poll)
        return not poll.cut.is_set()

    def relieve(self, peer: str | None = None) -> bool:
        """End one held poll: one from ``peer`` (the oldest of a tenant's polls from there), or with no ``peer``
        the oldest of the tenant holding the most; whether there was one."""
        if peer is not None:
            for polls in self._held.values():
                poll = next((p for p in polls if p.peer == peer), None)
                if poll is not None:
                    self._end(poll)
                    return True
            return False
        if not self._held:
            return False
        self._end(next(iter(max(self._held.values(), key=len))))
        return True

    def _end(self, poll: _Poll) -> None:
        self.ended_early += 1
        poll.cut.set()
        self._forget(poll)

    def _forget(self, poll: _Poll) -> None:
        mine = self._held.get(poll.tenant)
        if mine is not None:
            mine.pop(poll, None)
            if not mine:
                del self._held[poll.tenant]


async def held_poll(request: Request, tenant: str, wait: Awaitable) -> bool:
    """``wait`` held as a long poll of ``tenant`` (``LongPolls.hold``); without a registry, simply awaited."""
    polls: LongPolls | None = getattr(request.app.state, "long_polls", None)
    if polls is None:
        await wait
        return True
    return await polls.hold(tenant, request.client.host if request.client else "", wait)
