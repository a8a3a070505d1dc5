"""Jobs' execution: the torch work for one base model runs on that model's own thread, tenants served in turn,
so the HTTP loop never blocks on torch (a job and how a caller waits for it: engine/jobs.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from server_mock.engine.backlog import Backlog
from server_mock.engine.jobs import Decoding, Job
from server_mock.engine.fairness import FairShare
from server_mock.errors import WorkerError, storage_error

logger = logging.getLogger("server_mock")
# the least a slice runs before the policy may hand the turn to an owner served less (so that two owners with
# work do not change places at every decode step or micro-batch); past ``slice_seconds`` any waiting owner's turn
MIN_TURN_SECONDS = 0.05


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
class _Steps:
    """A job that runs in slices (``Job.open_steps``): resumed at its owner's turn, before the owner's next job."""

    owner: str
    job: Job
    steps: Iterator[int]


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

    The jobs wait in a ``Backlog`` (engine/backlog.py): each tenant (job owner) has a FIFO lane; the thread takes
    one job from each waiting lane in turn, so a tenant with many queued requests delays another tenant's request
    by at most the one job that is running when it arrives. A run belongs to one tenant, so its ops keep their
    seq_id order.

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

    A job that can pause between its parts (``Job.open_steps``: a long forward/backward, paused between
    micro-batches) runs the same way: for ``slice_seconds`` at a time when other owners wait, resumed at its
    owner's next turn. Its result is that of running it in one go, bit for bit: nothing else touches its run.

    Whose turn it is, of the owners with work, is the ``policy``'s choice (engine/fairness.py), which the backlog
    asks: by default the owner served the least cost (weighted), ties to the one that waited longest; the queue
    charges it the cost of what it runs (forward tokens when a forward op or part of one runs, decode tokens step
    by step, a sample's exact prompt and output tokens when it ends).
    """

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, batch_token_budget: int = 65536,
                 batch_window: float = 0.005, slice_seconds: float = 0.5,
                 observer: QueueObserver | None = None, policy: FairShare | None = None) -> None:
        self.name = name
        self.observer = observer or _Unobserved()
        self._backlog: Backlog[Job] = Backlog(policy)
        self.loop = loop
        self.batch_token_budget = batch_token_budget
        # a short wait lets requests sent together arrive together; skipped while other owners have work (the
        # model would idle while they wait; later arrivals for the weights join the decode batch at its next step)
        self.batch_window = batch_window
        self.slice_seconds = slice_seconds
        self.slice_jobs = True  # False: a job that could run in slices runs in one go (``Job.fn``)
        self._thread = threading.Thread(target=self._run, name=f"model-{name}", daemon=True)
        self._thread.start()

    @property
    def policy(self) -> FairShare:
        """Whose turn it is (engine/fairness.py): the backlog's policy, which may be replaced."""
        return self._backlog.policy

    @policy.setter
    def policy(self, policy: FairShare) -> None:
        self._backlog.policy = policy

    def put(self, job: Job) -> None:
        self._backlog.put(job)

    def position(self, request_id: str) -> int | None:
        """How many queued jobs will be taken before this one, None if not queued (``Backlog.position``)."""
        return self._backlog.position(request_id)

    def fairness(self) -> dict[str, dict[str, float]]:
        """The policy's books per owner (counter, served cost, weight): the metrics and the operator's view."""
        return self._backlog.books()

    def depth(self) -> int:
        return self._backlog.depth()

    def waiting(self) -> collections.Counter[tuple[str, str]]:
        """Queued jobs by (owner, kind), for the operator's queue-depth gauge."""
        return self._backlog.waiting()

    def stop(self) -> None:
        self._backlog.stop()

    def _charge(self, job: Job, cost: float) -> None:
        if cost:
            self._backlog.charge(job.owner, cost)
            job.charged += cost

    def _run(self) -> None:
        while True:
            turn = self._backlog.next_turn()
            if turn is None:
                return
            owner, head, resumed = turn
            if resumed is not None:
                if isinstance(resumed, _Steps):
                    self._step(resumed)
                else:
                    self._slice(resumed)
                continue
            if head.open_steps is not None and self.slice_jobs:
                self._begin_steps(owner, head)
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
            if self.batch_window > 0 and not self._backlog.others_wait(owner):
                time.sleep(self.batch_window)
            group = [head] + self._backlog.take(lambda job, key=head.batch_key: job.batch_key == key,
                                                self.batch_token_budget - head.batch_cost)
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
            self._backlog.hold(owner, session)
            if session.mix is not None:  # queued jobs of other weights of its mix key start with it
                group += self._backlog.take(session.takes, self.batch_token_budget - sum(j.batch_cost for j in group))
            self._add_all(session, group)
            self._slice(session)

    def _running_for(self, job: Job) -> _Session | None:
        """A decode session for the job's weights that can take it now (within the token budget)."""
        for session in self._backlog.in_progress():
            if (isinstance(session, _Session) and session.takes(job)
                    and session.cost + job.batch_cost <= self.batch_token_budget and session.decoding.can_add()):
                return session
        return None

    def _start(self, jobs: list[Job]) -> None:
        """The jobs begin to run: each is charged its request's fixed price now (its tokens as they run)."""
        now = time.monotonic()
        for job in jobs:
            job.status, job.started = "running", now
            job.charged += self._backlog.began(job.owner, job.kind)
        self.observer.started(jobs)

    def _encoded(self, job: Job, result: dict) -> dict:
        """The job's result in its submitter's wire form (the observer sees it as computed, once). A sample's
        exact cost is known now: what was charged for it step by step is set right."""
        if job.kind == "sample":
            prices = self.policy.prices
            cost = prices.of_request(job.kind) + prices.of_sample(int(result.get("input_tokens", 0) or 0),
                                                                  int(result.get("output_tokens", 0) or 0))
            self._charge(job, cost - job.charged)
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

    def _add_all(self, session: _Session, jobs: list[Job]) -> None:
        """Prefill the jobs into the session together where the decoding can (``add_many``: one prefill for all,
        whatever adapters they use); if that fails none was admitted, and each is added alone, so that only a
        request that fails alone fails."""
        add_many = getattr(session.decoding, "add_many", None)
        if add_many is None or len(jobs) < 2:
            for job in jobs:
                self._add(session, job)
            return
        self._start(jobs)
        try:
            handles = add_many([job.payload for job in jobs])
        except Exception as exc:  # noqa: BLE001 - none was admitted: each tries alone, to fail on its own
            logger.info("admitting %d requests together failed (%s); adding them one by one", len(jobs), exc)
            for job in jobs:
                self._admit(session, job)
            return
        for job, handle in zip(jobs, handles):
            session.jobs[handle] = job
            session.cost += job.batch_cost

    def _add(self, session: _Session, job: Job) -> None:
        self._start([job])
        self._admit(session, job)

    def _admit(self, session: _Session, job: Job) -> None:
        """Prefill a started job into the session (a failure is the job's alone)."""
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
        started = time.monotonic()
        seen = 0  # queued jobs for these weights that did not fit at the last admission

        def queued() -> int:
            return self._backlog.queued(session.key, session.mix)

        def arrivals() -> bool:
            return queued() > seen and session.decoding.can_add()

        def turn_over() -> bool:
            return self._turn_over(session.owner, started)

        stepped = False  # whether a decode step ran since the last stop() (asked before every step)

        def charge_step() -> None:
            """The step that ran: each row decoded about one token (a request's exact cost is set at its end)."""
            for job in list(session.jobs.values()):
                self._charge(job, self.policy.prices.decode * job.rows)

        def stop() -> bool:
            nonlocal stepped
            if stepped:
                charge_step()  # charged as it runs, so that the policy sees who is being served now
            stepped = not (arrivals() or turn_over())
            return not stepped

        while True:
            if arrivals():
                self._add_all(session, self._backlog.take(session.takes, self.batch_token_budget - session.cost))
            seen = queued()
            self.observer.batch(list(session.jobs.values()))
            stepped = False
            try:
                finished = session.decoding.run(stop)
            except Exception as exc:  # noqa: BLE001 - the batch is unusable: each of its jobs runs again alone
                logger.warning("decode batch failed (%s: %s); running its %d jobs one by one", type(exc).__name__,
                               exc, len(session.jobs))
                self._backlog.release(session.owner, session)
                for job in session.jobs.values():
                    self._execute(job)
                return
            if stepped:  # the last step, after which the batch returned (a request finished, or none is left)
                charge_step()
            if finished:
                seen = 0  # the budget they held is free: jobs that did not fit may fit now
            for handle, result in finished:
                job = session.jobs.pop(handle)
                session.cost -= job.batch_cost
                self._finish(job, result=self._encoded(job, result))
            if not session.decoding.active:
                self._backlog.release(session.owner, session)
                for job in session.jobs.values():  # pragma: no cover - a finished batch has no open job
                    self._fail(job, RuntimeError("the decode batch ended without this request's result"))
                return
            if not arrivals() and turn_over():  # a job that arrived for these weights joins first
                return

    def _turn_over(self, owner: str, started: float) -> bool:
        """Whether a slice that began at ``started`` yields now: when another owner has work (or the queue is
        stopping) and either the slice has run ``slice_seconds``, or it has run ``MIN_TURN_SECONDS`` and the
        policy says another's turn is due (one of them has been served less: a tenant back from idle, lifted to
        this one's counter, waits for a few steps, not a whole slice)."""
        ran = time.monotonic() - started
        if ran < min(self.slice_seconds, MIN_TURN_SECONDS):
            return False
        return self._backlog.should_yield(owner, ran >= self.slice_seconds)

    # --- jobs in slices -----------------------------------------------------------------------------------

    def _begin_steps(self, owner: str, job: Job) -> None:
        self._start([job])
        try:
            steps = job.open_steps()
        except Exception as exc:  # noqa: BLE001 - e.g. a request the host refuses: this request alone fails
            self._fail(job, exc)
            return
        session = _Steps(owner, job, steps)
        self._backlog.hold(owner, session)
        self._step(session)

    def _step(self, session: _Steps) -> None:
        """Run the job's parts until it ends, or its slice is over and another owner waits for a turn."""
        job = session.job
        started = time.monotonic()
        while True:
            try:
                tokens = next(session.steps)
            except StopIteration as end:
                result = end.value
                self._backlog.release(session.owner, session)
                self._execute(job, lambda result=result: result)
                return
            except Exception as exc:  # noqa: BLE001 - the error goes back to this request only
                self._backlog.release(session.owner, session)
                self._fail(job, exc)
                return
            self._charge(job, self.policy.prices.of_forward(job.kind, tokens))
            if self._turn_over(session.owner, started):
                return

    def _execute(self, job: Job, work: Callable[[], dict] | None = None) -> None:
        if work is None:
            self._charge(job, self.policy.prices.of_forward(job.kind, job.tokens))
        try:
            self._finish(job, result=self._encoded(job, (work or job.fn)()))
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
        job.open_decode = job.open_steps = None
        self.observer.finished(job)
        if job.done is not None:
            self.loop.call_soon_threadsafe(_announce, job)


def _announce(job: Job) -> None:
    job.done.set()
    if job.on_finish is not None:
        job.on_finish(job)


def _done() -> dict:
    return {}
