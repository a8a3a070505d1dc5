"""One training run's events: the table that makes ``event_id`` idempotent, their order, and their answers.

A run's events are admitted in ``metadata.index`` order (the SDK submits one at a time, each after the previous
one was answered) and run in that order: a drain task takes them one by one and starts each (``execute``), which
hands a training op to the service and returns without waiting for it, so the model's queue stays full while the
next event is prepared. A re-sent event (same id, same bytes) is answered with its current status and never runs
twice. Answers are msgpack bytes, built once when the event ends and kept ``ttl`` seconds (at least the last
``keep`` per run), because the SDK may poll or re-submit for up to 900 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from server_mock.api.pytrio import event_wire as wire
from server_mock.api.pytrio.kept_answers import KeptAnswers
from server_mock.api.pytrio.msgpack_codec import encode
from server_mock.engine.jobs import Job

MAX_WAITING = 16  # admitted events of a run not started yet; one more is refused (it may be sent again)
logger = logging.getLogger("server_mock")


@dataclass
class Event:
    event_id: str
    type: str
    index: int
    digest: bytes  # of the submitted body: tells a re-sent event from a conflicting one
    payload: Any = None  # the parsed payload, until the event runs
    answer: bytes | None = None  # the finished answer
    job: Job | None = None  # the service job running it, once handed over
    ended: float | None = None  # monotonic
    done: asyncio.Event = field(default_factory=asyncio.Event)
    taken: asyncio.Event = field(default_factory=asyncio.Event)  # handed to the service (journaled), or answered
    recorded: bool = False  # has a protocol record (api/pytrio/durable.py), deleted when it is forgotten
    on_finish: Callable[[Event], None] | None = None  # its table counts its answer in the key's budget

    @property
    def finished(self) -> bool:
        return self.answer is not None

    def current(self) -> bytes:
        """The answer as of now: finished, or accepted / running."""
        if self.answer is not None:
            return self.answer
        running = self.job is not None and self.job.status == "running"
        return encode(wire.pending(self.event_id, self.type, running))

    def finish(self, answer: wire.EventStatusOut | bytes) -> None:
        self.answer = answer if isinstance(answer, bytes) else encode(answer)
        self.ended = time.monotonic()
        self.payload = self.job = None
        self.done.set()
        self.taken.set()
        if self.on_finish is not None:
            self.on_finish(self)

    def fail(self, code: str, message: str, usage: wire.UsageOut | None = None) -> None:
        self.finish(wire.failed(self.event_id, self.type, code, message, usage))

    async def wait(self, timeout: float, until: asyncio.Event | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the event to end (or ``until`` to be set); whether it happened."""
        flag = self.done if until is None else until
        if not flag.is_set() and timeout > 0:
            try:
                await asyncio.wait_for(flag.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return flag.is_set()


Execute = Callable[[Event], Awaitable[None]]


class EventTable:
    """A run's events by id, the next index it admits, and the queue of admitted events not yet started."""

    def __init__(self, keep: int, ttl: float, execute: Execute, keep_bytes: int = 128 << 20,
                 forget: Callable[[Event], None] | None = None, answers: KeptAnswers | None = None,
                 tenant: str = "") -> None:
        self.keep, self.ttl, self.execute, self.keep_bytes = keep, ttl, execute, keep_bytes
        self.forget = forget  # called with each event dropped by ``prune`` (its record goes too)
        self.answers, self.tenant = answers, tenant  # the key's budget of kept answers (--max-result-bytes)
        self.next_index = 1
        self.events: OrderedDict[str, Event] = OrderedDict()
        self.admitting = asyncio.Lock()  # submits of this run, one at a time
        self._queue: deque[Event] = deque()
        self._drain: asyncio.Task | None = None
        self._watchers: set[asyncio.Task] = set()
        self.closed = False

    def get(self, event_id: str) -> Event | None:
        return self.events.get(event_id)

    def pending(self) -> int:
        return sum(1 for e in self.events.values() if not e.finished)

    def waiting(self) -> int:
        """Admitted events not started yet (the SDK has at most one: it submits the next once this one is
        acknowledged, and it is acknowledged once started)."""
        return len(self._queue)

    def record(self, event: Event, advance: bool = True) -> None:
        """Keep ``event`` (answered now, or ``admit``-ed next) under its id; ``advance`` uses up its index."""
        self.events[event.event_id] = event
        if advance:
            self.next_index = event.index + 1
        if self.answers is not None:
            if event.finished:
                self._answered(event)
            else:
                event.on_finish = self._answered
        self.prune()

    def _answered(self, event: Event) -> None:
        if self.events.get(event.event_id) is event and self.answers is not None and not self.closed:
            self.answers.keep(self.tenant, (id(self), event.event_id), len(event.answer),
                              lambda: self._dropped(event))

    def _dropped(self, event: Event) -> None:
        """Forgotten for the key's budget of kept answers."""
        if self.events.get(event.event_id) is event:
            del self.events[event.event_id]
            if self.forget is not None:
                self.forget(event)

    def admit(self, event: Event) -> None:
        """Queue an accepted event to run after those before it."""
        self.record(event)
        self._queue.append(event)
        if self._drain is None or self._drain.done():
            self._drain = asyncio.ensure_future(self._run_queue())

    def watch(self, event: Event, job: Job, finish: Callable[[Job], wire.EventStatusOut | bytes]) -> None:
        """The event ends when the service job does: ``finish(job)`` gives its answer."""
        event.job = job
        event.taken.set()

        async def watcher() -> None:
            if job.done is not None:
                await job.done.wait()
            try:
                event.finish(finish(job))
            except Exception as exc:  # noqa: BLE001 - an answer we cannot build is still an answer
                logger.exception("pytrio: could not build the answer of %s", event.event_id)
                event.fail("internal_error", f"{type(exc).__name__}: {exc}")

        task = asyncio.ensure_future(watcher())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _run_queue(self) -> None:
        while self._queue and not self.closed:
            event = self._queue.popleft()
            try:
                await self.execute(event)
            except asyncio.CancelledError:
                if not event.finished:
                    event.fail("run_released", "the training run was released while this event ran")
                raise
            except Exception as exc:  # noqa: BLE001 - the event fails, the run goes on
                logger.exception("pytrio: event %s (%s) failed", event.event_id, event.type)
                if not event.finished:
                    event.fail("internal_error", f"{type(exc).__name__}: {exc}")
            finally:
                event.taken.set()

    def prune(self, now: float | None = None) -> None:
        """Forget finished events past their TTL, and the oldest finished ones beyond ``keep`` events or
        ``keep_bytes`` of answers."""
        now = time.monotonic() if now is None else now
        finished = [e for e in self.events.values() if e.finished]
        extra = len(finished) - self.keep
        held = sum(len(e.answer) for e in finished)
        for event in finished:
            if extra > 0 or held > self.keep_bytes or now - (event.ended or now) > self.ttl:
                del self.events[event.event_id]
                extra -= 1
                held -= len(event.answer)
                if self.answers is not None:
                    self.answers.drop(self.tenant, (id(self), event.event_id))
                if self.forget is not None:
                    self.forget(event)

    def close(self, reason: str) -> None:
        """The run is released: events not started fail; the one being started and those running on the model
        end as they finish (a start is not cancelled midway: an adapter being made would be left behind)."""
        self.closed = True
        if self.answers is not None:
            for event_id in self.events:
                self.answers.drop(self.tenant, (id(self), event_id))
        while self._queue:
            self._queue.popleft().fail("run_released", reason)
