"""Per-model ``seq_id`` ordering for the Tinker protocol, with bounds on what waiting requests hold.

``SeqGate`` puts one training model's requests in ``seq_id`` order before they reach the service.
The client numbers them 1, 2, ... and sends a batch's chunks in parallel, the first chunk last and only
after the others have been answered: so a request that arrives early gets its future at once and is
handed to the service when its predecessors have been. A re-sent ``seq_id`` gets the original future.
Every admitted ``seq_id`` yields a future, a failed one if the request was invalid, so a rejected
request never stalls the requests behind it.

A request whose turn has come but that is over its API key's token budget (``RateLimited``) is accepted and
held, its future paused (``paused``: Tinker's ``paused_rate_limit``), and handed over when the budget has room;
the model's later requests wait behind it, as they would behind a gap.

Bounds: a request may be at most ``max_ahead`` seq_ids ahead of the next expected one (400 otherwise),
at most ``max_waiting`` requests of a model wait at once, and the bytes held by waiting requests are
counted per session and on the whole worker by ``holding.HeldBytes`` (429 past either limit). A gap that is
never filled is skipped after ``gap_wait`` seconds in O(1): the skipped range is remembered as one
interval, not seq_id by seq_id.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from server_mock.api.tinker.holding import HeldBytes, Slim
from server_mock.errors import WorkerError, raising
from server_mock.service.rate_limits import READY_POLL_SECONDS, RateLimited

logger = logging.getLogger("server_mock")


@dataclass
class _Waiting:
    request_id: str
    digest: str
    submit: Callable[[], Awaitable[Any]] | None
    slot: asyncio.Future
    size: int
    prepare: Callable[[], Callable[[], Awaitable[Any]]] | None = None
    retry_in: float | None = None  # held back by its key's token budget: seconds until it is tried again


async def _when_submitted(slot: asyncio.Future) -> Any:
    work = await slot
    return await work


class SeqGate:
    """Hands one model's requests to the service strictly in seq_id order (see the module docstring).

    ``submit()`` hands a request to the service and returns the awaitable of its result (an invalid
    request's awaitable raises). It may raise a 429 WorkerError instead, when the service's queue is
    full: an in-order request is then turned away with that error (the client re-sends it), and a held
    one is retried shortly, holding up its successors.
    """

    def __init__(self, first: int = 1, gap_wait: float = 60.0, max_waiting: int = 256, max_ahead: int = 1024,
                 keep: int = 4096, retry_after: float = 0.5, held: HeldBytes | None = None, owner: str = "",
                 paused: Callable[[str, str | None], None] | None = None) -> None:
        self.next = first
        self.gap_wait = gap_wait
        self.max_waiting = max_waiting
        self.max_ahead = max_ahead
        self.keep = keep
        self.retry_after = retry_after
        self.held = held
        self.owner = owner
        # told (request id, why) when a request is held back by its key's token budget, (request id, None) when it
        # goes on; None: such a request is turned away with its 429 instead, as a full queue's is
        self.paused = paused
        self._admitted: OrderedDict[int, tuple[str, str]] = OrderedDict()  # seq -> (request id, digest)
        self._skipped: deque[tuple[int, int]] = deque(maxlen=64)  # [lo, hi) ranges given up on
        self._waiting: dict[int, _Waiting] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._preparing: asyncio.Task | None = None
        self._progress_at = 0.0

    def admit(self, seq: int, digest: str, submit: Callable[[], Awaitable[Any]],
              add_future: Callable[[Awaitable[Any]], str], fail: Callable[[str], str], size: int = 0,
              slim: Slim | None = None) -> str:
        """The request id of ``seq``: a new future, or the original one for a re-send.

        ``add_future(awaitable)`` registers a future and returns its id; ``fail(message)`` registers a
        failed one, for a request that cannot be admitted at all. ``size``: the bytes the request
        keeps while it waits for its turn; ``slim``: a smaller form to keep instead, if it has one.
        """
        seen = self._admitted.get(seq)
        if seen is None and seq in self._waiting:
            seen = (self._waiting[seq].request_id, self._waiting[seq].digest)
        if seen is not None:
            request_id, seen_digest = seen
            if seen_digest != digest:
                return fail(f"seq_id {seq} was already used by a different request on this model")
            return request_id
        if seq < self.next:
            if any(lo <= seq < hi for lo, hi in self._skipped):
                return fail(f"seq_id {seq} arrived after the later requests of this model had already run "
                            f"(it was given up on after waiting {self.gap_wait:.0f}s; this model is at seq_id "
                            f"{self.next})")
            return fail(f"seq_id {seq} is too old (this model is at seq_id {self.next})")
        if seq - self.next >= self.max_ahead:
            raise WorkerError(400, "seq_id_too_far_ahead",
                              f"seq_id: {seq} is too far ahead: the next expected seq_id of this model is "
                              f"{self.next}, and a request may be at most {self.max_ahead - 1} past it "
                              f"(limit max_seq_ahead={self.max_ahead})", "seq_id")
        loop = asyncio.get_running_loop()
        if not self._waiting:
            self._progress_at = loop.time()
        if seq == self.next:
            try:
                work = submit()  # a full queue's 429 propagates: nothing is recorded, the client re-sends
            except RateLimited as exc:
                if self.paused is None:
                    raise
                return self._hold(seq, digest, submit, add_future, size, exc)
            request_id = add_future(work)
            self._record(seq, request_id, digest)
            self._drain()
            return request_id
        if len(self._waiting) >= self.max_waiting:
            raise WorkerError(429, "too_many_waiting_requests",
                              f"seq_id: {len(self._waiting)} requests of this model already wait for seq_id "
                              f"{self.next} (limit max_waiting_requests={self.max_waiting}); retry shortly", "seq_id")
        waiting = _Waiting("", digest, submit, loop.create_future(), size)
        if slim is not None and slim.size < size:
            waiting.submit, waiting.prepare, waiting.size = None, slim.prepare, slim.size
        if self.held is not None:
            self.held.reserve(self.owner, waiting.size)  # a 429: nothing recorded
        waiting.request_id = add_future(_when_submitted(waiting.slot))
        self._waiting[seq] = waiting
        self._schedule()
        return waiting.request_id

    def _hold(self, seq: int, digest: str, submit: Callable[[], Awaitable[Any]],
              add_future: Callable[[Awaitable[Any]], str], size: int, refusal: RateLimited) -> str:
        """The next seq_id, over its key's token budget: accepted and held (its future paused) until the budget
        has room, its successors waiting behind it; when the held bytes have no room for it either, the client is
        turned away with the 429 (its HTTP layer re-sends, honouring Retry-After)."""
        if self.held is not None:
            try:
                self.held.reserve(self.owner, size)
            except WorkerError:
                raise refusal from None
        waiting = _Waiting("", digest, submit, asyncio.get_running_loop().create_future(), size)
        waiting.request_id = add_future(_when_submitted(waiting.slot))
        self._waiting[seq] = waiting
        self._pause(waiting, refusal)
        return waiting.request_id

    def _pause(self, waiting: _Waiting, refusal: RateLimited) -> None:
        """``waiting`` is held back by its budget: its future says so, and it is tried again when it should fit."""
        self.paused(waiting.request_id, refusal.message)
        waiting.retry_in = min(max(refusal.wait, 0.05), READY_POLL_SECONDS)  # refunds may make room sooner
        self._schedule()

    def restore(self, seq: int, request_id: str, digest: str) -> None:
        """A seq_id admitted before a restart (journaled with its op): a re-send gets ``request_id`` back, and the
        next expected seq_id is past it."""
        self._admitted[seq] = (request_id, digest)
        while len(self._admitted) > self.keep:
            self._admitted.popitem(last=False)
        self.next = max(self.next, seq + 1)

    def close(self, reason: str) -> None:
        """Fail every waiting request (its model is gone) and give back what they held."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._preparing is not None:
            self._preparing.cancel()
            self._preparing = None
        for waiting in self._waiting.values():
            if not waiting.slot.done():
                waiting.slot.set_exception(WorkerError(404, "model_not_found", reason, "model_id"))
            self._release(waiting)
        self._waiting.clear()

    @property
    def waiting_bytes(self) -> int:
        return sum(w.size for w in self._waiting.values())

    def _release(self, waiting: _Waiting) -> None:
        if self.held is not None:
            self.held.release(self.owner, waiting.size)

    def _record(self, seq: int, request_id: str, digest: str) -> None:
        self._admitted[seq] = (request_id, digest)
        while len(self._admitted) > self.keep:
            self._admitted.popitem(last=False)
        self.next = max(self.next, seq + 1)
        self._progress_at = asyncio.get_running_loop().time()

    def _drain(self) -> None:
        while self.next in self._waiting:
            waiting = self._waiting[self.next]
            if waiting.prepare is not None:  # back to its full form in a thread first, then on
                if self._preparing is None:
                    self._preparing = asyncio.ensure_future(self._prepare(waiting))
                return
            try:
                work = waiting.submit()
            except RateLimited as exc:
                if self.paused is None:
                    break  # retried by the timer, as a full queue is
                self._pause(waiting, exc)
                return
            except WorkerError as exc:
                if exc.status == 429:
                    break  # queue full: retried by the timer
                waiting.slot.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - the request's own future carries the error
                waiting.slot.set_exception(exc)
            else:
                waiting.slot.set_result(work)
            if waiting.retry_in is not None and self.paused is not None:
                self.paused(waiting.request_id, None)
            del self._waiting[self.next]
            self._release(waiting)
            self._record(self.next, waiting.request_id, waiting.digest)
        self._schedule()

    async def _prepare(self, waiting: _Waiting) -> None:
        try:
            waiting.submit = await asyncio.to_thread(waiting.prepare)
        except Exception as exc:  # noqa: BLE001 - the request's own future carries the error
            waiting.submit = raising(exc)
        waiting.prepare = None
        self._preparing = None
        self._drain()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiting:
            return
        loop = asyncio.get_running_loop()
        if self._preparing is not None:
            return  # the request at the head is being prepared; draining goes on when it is
        if self.next in self._waiting:  # held back by a full queue, or by its key's token budget
            retry_in = self._waiting[self.next].retry_in
            self._timer = loop.call_later(self.retry_after if retry_in is None else retry_in, self._drain)
        else:  # a gap: wait for the missing requests, but not forever
            self._timer = loop.call_at(self._progress_at + self.gap_wait, self._skip_gap)

    def _skip_gap(self) -> None:
        self._timer = None
        if not self._waiting or self.next in self._waiting:
            self._drain()
            return
        first = min(self._waiting)  # O(waiting), at most max_waiting
        logger.warning("tinker: seq_id %d..%d never arrived within %.0fs; running seq_id %d and later without them",
                       self.next, first - 1, self.gap_wait, first)
        self._skipped.append((self.next, first))
        self.next = first
        self._drain()
