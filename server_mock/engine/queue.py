"""Jobs and their execution: the torch work for one base model runs on that model's own thread, tenants
served in turn, so the HTTP loop never blocks on torch. ``job_result`` is how every caller waits for a job.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from server_mock.errors import WorkerError, storage_error

logger = logging.getLogger("server_mock")


@dataclass
class Job:
    request_id: str
    kind: str
    fn: Callable[[], dict]
    owner: str = ""
    status: str = "queued"
    result: dict | None = None
    error: WorkerError | None = None
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    done: asyncio.Event | None = None
    # Jobs with the same batch_key may run together: batch_fn maps their payloads to their results.
    batch_key: str | None = None
    payload: Any = None
    batch_fn: Callable[[list[Any]], list[dict]] | None = None
    batch_cost: int = 0
    # Jobs with the same mix_key may join a running decode batch of other weights, where that batch can hold rows
    # of several (``Decoding.mixes``): the same base model, and the same tenant unless tenants may share a batch.
    mix_key: str | None = None
    # Where the host decodes in slices: opens a Decoding for this job's weights (None: batch_fn runs the batch).
    open_decode: Callable[[], "Decoding | None"] | None = None
    # The submitter's conversion of the result to its wire form, run once on the model thread (None: as is).
    encode: Callable[[dict], dict] | None = None
    # Called on the event loop once the job has finished (the request store counts what its result holds).
    on_finish: Callable[[Job], None] | None = None
    # Called on the model's thread with the result or error before the job is marked finished (the durable
    # journal records it there, so a client never sees a finished request that a crash could lose); an
    # exception from it fails the job with that error instead.
    on_result: Callable[[Job, dict | None, WorkerError | None], None] | None = None
    # What the service charged at admission and the run or sampler the job is for (service/usage.py reads them:
    # a forward op's datum tokens, a sample's prompt + num_samples x max_tokens; the scope of its trace).
    tokens: int = 0
    scope: str = ""


class Decoding(Protocol):
    """Sample jobs for the same weights decoding as one batch, in slices (service/samplers.py wraps an engine
    ``SamplingSession``). ``add`` prefills a job's request into the batch; ``run`` decodes until one finishes,
    nothing is left, or ``stop()`` (asked before every step) says to yield."""

    @property
    def active(self) -> bool: ...

    @property
    def mixes(self) -> bool:
        """Whether jobs for other weights (of the same ``mix_key``) can join this batch."""
        ...

    def can_add(self) -> bool: ...

    def add(self, payload: Any) -> int: ...

    def run(self, stop: Callable[[], bool]) -> list[tuple[int, dict]]: ...


class QueueObserver(Protocol):
    """What the queue tells its observer (service/usage.py), on the model's thread; it must be cheap and never
    raise. ``started``: jobs taken to run; ``batch``: the jobs that decode together now; ``computed``: a job's
    result as the work returned it (before ``encode``); ``finished``: its status and result are set."""

    def started(self, jobs: list[Job]) -> None: ...

    def batch(self, jobs: list[Job]) -> None: ...

    def computed(self, job: Job, result: dict) -> None: ...

    def finished(self, job: Job) -> None: ...


class _Unobserved:
    def started(self, jobs: list[Job]) -> None:
        pass

    def batch(self, jobs: list[Job]) -> None:
        pass

    def computed(self, job: Job, result: dict) -> None:
        pass

    def finished(self, job: Job) -> None:
        pass


@dataclass
class _Session:
    """A decode batch in progress: whose turn resumes it, its weights, and its jobs by handle."""

    owner: str
    key: str
    decoding: Decoding
    jobs: dict[int, Job] = field(default_factory=dict)
    cost: int = 0
    mix: str | None = None  # jobs of this mix key join it whatever their weights (a mixed-adapter batch)

    def takes(self, job: Job) -> bool:
        return job.batch_key == self.key or (self.mix is not None and job.mix_key == self.mix)


class ModelQueue:
    """The jobs for one base model, drained by one thread, tenants served in turn.

    Each tenant (job owner) has a FIFO lane; the thread takes one job from each waiting lane in turn,
    so a tenant with many queued requests delays another tenant's request by at most the one job that
    is running when it arrives. A run belongs to one tenant, so its ops keep their seq_id order.

    Sampling jobs for the same weights are coalesced: when one is taken, every queued job with its
    batch_key joins it (up to a token budget) and they decode as one batch. This is safe to reorder
    because a sampler reads an immutable snapshot, never the training state.

    Where the host can decode in slices (``Job.open_decode``), that batch is a session that lives across turns:
    it decodes for ``slice_seconds`` at a time when other lanes wait (then the next lane takes its turn and
    the session resumes at its owner's next turn, before the owner's next job), and a job for the same weights
    queued while it decodes joins it at its next step (continuous admission, within the token budget). So a
    tenant waits for at most one slice of another's long decode, not for all of it; each job's result is
    delivered as soon as its own rows end. A session that can hold rows of several adapters (``Decoding.mixes``)
    also admits, the same way, queued jobs of its ``mix_key`` whatever their weights.
    """

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, batch_token_budget: int = 65536,
                 batch_window: float = 0.005, slice_seconds: float = 0.5,
                 observer: QueueObserver | None = None) -> None:
        self.name = name
        self.observer = observer or _Unobserved()
        self.loop = loop
        self.batch_token_budget = batch_token_budget
        self.batch_window = batch_window  # a short wait lets requests sent together arrive together
        self.slice_seconds = slice_seconds
        self._lanes: collections.OrderedDict[str, collections.deque[Job]] = collections.OrderedDict()
        self._served: str | None = None  # the lane served last: it rejoins the rotation behind new arrivals
        self._sessions: dict[str, _Session] = {}  # by owner: a decode batch to resume at the owner's turn
        self._keys_queued: collections.Counter[str] = collections.Counter()  # queued jobs by batch key
        self._mix_queued: collections.Counter[str] = collections.Counter()  # queued jobs by mix key
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"model-{name}", daemon=True)
        self._thread.start()

    def put(self, job: Job) -> None:
        with self._cond:
            lane = self._lanes.get(job.owner)
            if lane is None:
                lane = self._lanes[job.owner] = collections.deque()
            lane.append(job)
            if job.batch_key is not None:
                self._keys_queued[job.batch_key] += 1
            if job.mix_key is not None:
                self._mix_queued[job.mix_key] += 1
            self._cond.notify()

    def position(self, request_id: str) -> int | None:
        """How many queued jobs will be taken before this one (in turn order), None if not queued. A decode
        session waiting for its owner's turn counts as one job ahead of the owner's lane."""
        with self._cond:
            lanes = [([None] if owner in self._sessions else []) + list(lane) for owner, lane in self._rotation()]
            for index, lane in enumerate(lanes):
                for depth, job in enumerate(lane):
                    if job is not None and job.request_id == request_id:
                        before = sum(min(len(other), depth) for other in lanes)
                        return before + sum(1 for other in lanes[:index] if len(other) > depth)
        return None

    def depth(self) -> int:
        with self._cond:
            return sum(len(lane) for lane in self._lanes.values())

    def waiting(self) -> collections.Counter[tuple[str, str]]:
        """Queued jobs by (owner, kind), for the operator's queue-depth gauge."""
        with self._cond:
            return collections.Counter((job.owner, job.kind) for lane in self._lanes.values() for job in lane)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _ready(self, owner: str) -> bool:
        return owner in self._sessions or bool(self._lanes.get(owner))

    def _rotation(self) -> list[tuple[str, collections.deque[Job]]]:
        """The owners with work, in the order they will be served (the last-served one last). An owner with a
        decode session keeps its place in the rotation even while its lane is empty."""
        order = [(owner, lane) for owner, lane in self._lanes.items() if owner != self._served and self._ready(owner)]
        if self._served is not None and self._ready(self._served):
            order.append((self._served, self._lanes[self._served]))
        return order

    def _pop(self, owner: str, job: Job) -> None:
        lane = self._lanes[owner]
        lane.remove(job)
        if not lane and owner not in self._sessions:
            del self._lanes[owner]
        if job.batch_key is not None:
            self._keys_queued[job.batch_key] -= 1
        if job.mix_key is not None:
            self._mix_queued[job.mix_key] -= 1

    def _next_turn(self) -> tuple[str, Job | None] | None:
        """The next owner's turn: its session to resume (job None) or its lane's next job (taken off)."""
        with self._cond:
            while not self._stopped and not self._lanes:
                self._cond.wait()
            if self._stopped:
                return None
            if self._served in self._lanes:
                self._lanes.move_to_end(self._served)  # behind every lane that waited meanwhile
            owner = next(owner for owner in self._lanes if self._ready(owner))
            self._served = owner
            if owner in self._sessions:
                return owner, None
            head = self._lanes[owner][0]
            self._pop(owner, head)
            return owner, head

    def _joiners(self, key: str, budget: int, session: _Session | None = None) -> list[Job]:
        """Take every queued job with batch key ``key`` (or that ``session`` takes) that fits ``budget`` (lane
        order, then job order)."""
        group = []
        with self._cond:
            for owner in list(self._lanes):
                for job in list(self._lanes[owner]):
                    fits = job.batch_key == key if session is None else session.takes(job)
                    if fits and job.batch_cost <= budget:
                        group.append(job)
                        budget -= job.batch_cost
                        self._pop(owner, job)
        return group

    def _run(self) -> None:
        while True:
            turn = self._next_turn()
            if turn is None:
                return
            owner, head = turn
            if head is None:
                self._slice(self._sessions[owner])
                continue
            if head.batch_key is None:
                self._start([head])
                self._execute(head)
                continue
            running = self._running_for(head)
            if running is not None:  # its weights are decoding: it joins that batch, which runs this turn
                self._add(running, head)
                self._slice(running)
                continue
            if self.batch_window > 0:
                time.sleep(self.batch_window)
            group = [head] + self._joiners(head.batch_key, self.batch_token_budget - head.batch_cost)
            decoding = None
            if head.open_decode is not None:
                try:
                    decoding = head.open_decode()
                except Exception:  # noqa: BLE001 - e.g. weights that cannot load: each job reports its own error
                    logger.warning("opening a decode batch failed; running its %d jobs one by one", len(group))
                    self._start(group)
                    for job in group:
                        self._execute(job)
                    continue
            if decoding is None:
                self._start(group)
                self._run_batch(group)
                continue
            session = _Session(owner, head.batch_key, decoding,
                               mix=head.mix_key if getattr(decoding, "mixes", False) else None)
            with self._cond:
                self._sessions[owner] = session
                self._lanes.setdefault(owner, collections.deque())
            for job in group:
                self._add(session, job)
            self._slice(session)

    def _running_for(self, job: Job) -> _Session | None:
        """A decode session for the job's weights that can take it now (within the token budget)."""
        with self._cond:
            sessions = list(self._sessions.values())
        for session in sessions:
            if (session.takes(job) and session.cost + job.batch_cost <= self.batch_token_budget
                    and session.decoding.can_add()):
                return session
        return None

    def _start(self, jobs: list[Job]) -> None:
        now = time.monotonic()
        for job in jobs:
            job.status, job.started = "running", now
        self.observer.started(jobs)

    def _encoded(self, job: Job, result: dict) -> dict:
        """The job's result in its submitter's wire form (the observer sees it as computed, once)."""
        self.observer.computed(job, result)
        return job.encode(result) if job.encode is not None else result

    def _run_batch(self, group: list[Job]) -> None:
        if len(group) > 1:
            self.observer.batch(group)
            try:
                results = group[0].batch_fn([job.payload for job in group])
            except Exception:  # noqa: BLE001 - one bad request must not fail its batch-mates
                logger.warning("batched %s failed; running its %d jobs one by one", group[0].kind, len(group))
            else:
                for job, result in zip(group, results):
                    self._finish(job, result=self._encoded(job, result))
                return
        for job in group:
            self._execute(job)

    # --- decode sessions --------------------------------------------------------------------------------

    def _add(self, session: _Session, job: Job) -> None:
        self._start([job])
        try:
            handle = session.decoding.add(job.payload)
        except Exception as exc:  # noqa: BLE001 - this request alone fails (its prefill left the batch as it was)
            self._fail(job, exc)
            return
        session.jobs[handle] = job
        session.cost += job.batch_cost

    def _slice(self, session: _Session) -> None:
        """Decode the session, admitting jobs for its weights as they arrive, until it ends or its slice is over
        and another owner waits for a turn."""
        deadline = time.monotonic() + self.slice_seconds
        seen = 0  # queued jobs for these weights that did not fit at the last admission

        def queued() -> int:
            if session.mix is not None:
                return self._mix_queued.get(session.mix, 0)
            return self._keys_queued.get(session.key, 0)

        def arrivals() -> bool:
            return queued() > seen and session.decoding.can_add()

        def turn_over() -> bool:
            if time.monotonic() < deadline:
                return False
            with self._cond:
                return self._stopped or any(o != session.owner and self._ready(o) for o in self._lanes)

        while True:
            if arrivals():
                for job in self._joiners(session.key, self.batch_token_budget - session.cost, session):
                    self._add(session, job)
            seen = queued()
            self.observer.batch(list(session.jobs.values()))
            try:
                finished = session.decoding.run(lambda: arrivals() or turn_over())
            except Exception as exc:  # noqa: BLE001 - the batch is unusable: each of its jobs runs again alone
                logger.warning("decode batch failed (%s: %s); running its %d jobs one by one", type(exc).__name__,
                               exc, len(session.jobs))
                self._close(session)
                for job in session.jobs.values():
                    self._execute(job)
                return
            if finished:
                seen = 0  # the budget they held is free: jobs that did not fit may fit now
            for handle, result in finished:
                job = session.jobs.pop(handle)
                session.cost -= job.batch_cost
                self._finish(job, result=self._encoded(job, result))
            if not session.decoding.active:
                self._close(session)
                for job in session.jobs.values():  # pragma: no cover - a finished batch has no open job
                    self._fail(job, RuntimeError("the decode batch ended without this request's result"))
                return
            if not arrivals() and turn_over():  # a job that arrived for these weights joins first
                return

    def _close(self, session: _Session) -> None:
        with self._cond:
            if self._sessions.get(session.owner) is session:
                del self._sessions[session.owner]
                if not self._lanes.get(session.owner, True):
                    del self._lanes[session.owner]

    def _execute(self, job: Job) -> None:
        try:
            self._finish(job, result=self._encoded(job, job.fn()))
        except Exception as exc:  # noqa: BLE001 - the error goes back to this request only
            self._fail(job, exc)

    def _fail(self, job: Job, exc: Exception) -> None:
        if isinstance(exc, WorkerError):
            self._finish(job, error=exc)
        elif isinstance(exc, torch.OutOfMemoryError):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._finish(job, error=WorkerError(500, "out_of_memory", f"out of memory while running {job.kind}: "
                                                f"{exc} (reduce the batch or sequence length)"))
        else:
            logger.error("request %s (%s) failed:\n%s", job.request_id, job.kind,
                         "".join(traceback.format_exception(exc)))
            self._finish(job, error=WorkerError(500, "internal_error", f"{job.kind} failed: "
                                                f"{type(exc).__name__}: {exc}"))

    def _finish(self, job: Job, result: dict | None = None, error: WorkerError | None = None) -> None:
        job.finished = time.monotonic()
        if result is not None and isinstance(result.get("metrics"), dict):
            # where the time went, per request: waiting for the model, then running on it
            result["metrics"]["time/queue"] = (job.started or job.finished) - job.created
            result["metrics"]["time/run"] = job.finished - (job.started or job.finished)
        if job.on_result is not None:
            try:
                job.on_result(job, result, error)
            except WorkerError as exc:
                result, error = None, exc
            except Exception as exc:  # noqa: BLE001 - the disk refused the result: this request fails, clearly
                logger.error("recording the result of %s (%s) failed: %s", job.request_id, job.kind, exc)
                result, error = None, storage_error(f"{job.kind} ran, but recording its result", exc)
        job.result, job.error = result, error
        job.status = "failed" if error is not None else "succeeded"
        job.fn, job.payload, job.batch_fn, job.encode = _done, None, None, None  # drop request tensors
        job.on_result = None
        job.open_decode = None
        self.observer.finished(job)
        if job.done is not None:
            self.loop.call_soon_threadsafe(_announce, job)


def _announce(job: Job) -> None:
    job.done.set()
    if job.on_finish is not None:
        job.on_finish(job)


def _done() -> dict:
    return {}


SERVER_ERROR_CODES = {"internal_error", "out_of_memory", "storage_full", "storage_failed"}


async def job_result(job: Job, convert: Callable[[dict], Any] | None = None) -> Any:
    """Wait for a job; its result through ``convert`` (which may be async), or its error as a WorkerError:
    500 for the worker's own failures (``SERVER_ERROR_CODES``), 400 for anything the request caused."""
    if job.done is not None:
        await job.done.wait()
    if job.status == "failed":
        err = job.error
        if err is None:
            raise WorkerError(500, "internal_error", f"{job.kind} failed")
        status = 500 if err.code in SERVER_ERROR_CODES else 507 if err.status == 507 else 400
        raise WorkerError(status, err.code, err.message, err.field)
    result = job.result or {}
    if convert is None:
        return result
    out = convert(result)
    if asyncio.iscoroutine(out):
        out = await out
    return out


