"""What the PyTRIO protocol remembers: service sessions, training and sampling runs, temporary sampler weights,
the Actor tokens, and when each is released.

Identifiers: a service session is ``ss_<hex>``; a training run's cuid is the service's own run id (``run-<hex>``),
so its checkpoints' ``trio://<run>/...`` paths name it and every protocol lists them under the same run; a
sampling run is ``sr_<hex>``. Everything is per tenant (API key): another tenant's objects answer 404.

Under ``--durability full`` all of it is recorded (``durable.py``) and comes back after a restart
(``restart.py``): the SDK, retrying its connection meanwhile, carries on with the same tokens, runs and events.
Under ``checkpoint-only`` it is memory only: after a restart the SDK's runs are gone (its calls get 401/404),
the checkpoints on disk stay. Nothing piles up: sessions per key are capped and idle ones closed; a training run
whose client stopped beating releases its adapter; sampling runs (the SDK never closes them, GRPO makes one per
step) are kept per key up to a count, least recently used first out, and expire when idle; temporary sampler
weights expire at their TTL. Every bound has a ``--pytrio-*`` flag (config.PytrioOptions, docs/reliability.md).

What a service session holds is its leases (service/sessions.py): its training runs, sampling runs and temporary
sampler weights (``TRAINING_RUN``, ``SAMPLING_RUN``, ``TEMPORARY_WEIGHTS``, by cuid and trio:// path). Closing it
releases each: a training run's adapter first, then its record.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pytrio_compat.wire import LoraSpec
from server_mock.api.pytrio.durable import PytrioJournal
from server_mock.api.pytrio.events import EventTable
from server_mock.api.pytrio.kept_answers import KeptAnswers
from server_mock.api.pytrio.tokens import ActorTokens
from server_mock.config import PytrioOptions
from server_mock.errors import WorkerError
from server_mock.service.sessions import ClientSessions
from server_mock.service.worker import WorkerService

logger = logging.getLogger("server_mock")

# what a service session leases (ClientSessions kinds)
TRAINING_RUN, SAMPLING_RUN, TEMPORARY_WEIGHTS = "training_run", "sampling_run", "temporary_weights"


@dataclass
class Session:
    cuid: str
    tenant: str
    sdk_version: str
    created: float
    last_seen: float
    status: str = "ACTIVE"


@dataclass
class TrainingRun:
    cuid: str  # also the service's run id, once initialised
    tenant: str
    session_cuid: str
    run_index: int
    alias: str  # the served model's name
    model_id: str  # what the SDK loads the tokenizer from (Models.tokenizer_id)
    lora: LoraSpec
    source_uri: str
    restore_optimizer: bool
    created: float
    last_seen: float
    token: str = ""
    token_expires: float = 0.0
    init: str = "none"  # none | pending | ready
    status: str = "CREATED"  # CREATED | ACTIVE | ENDED
    events: EventTable | None = None


@dataclass
class SamplingRun:
    cuid: str
    tenant: str
    session_cuid: str
    run_index: int
    alias: str
    model_id: str
    source_uri: str
    sampler_id: str  # the service's sampler
    created: float
    last_used: float
    token: str = ""
    token_expires: float = 0.0
    samples: OrderedDict = field(default_factory=OrderedDict)  # request_id -> task: retries answered once


@dataclass
class TemporaryWeights:
    """In-memory sampler weights of save_weights(TEMPORARY) (``save_weights_and_get_sampling_client``)."""

    tenant: str
    session_cuid: str
    expires: float


def _unknown_session(cuid: str) -> WorkerError:
    return WorkerError(404, "session_not_found", f"service_session: unknown service session {cuid!r} (it was closed, "
                                                 "or the worker restarted)", "service_session_cuid")


def workspace_of(tenant: str) -> str:
    return "ws_" + hashlib.sha256(tenant.encode()).hexdigest()[:16]


def model_cuid(alias: str) -> str:
    return "m_" + hashlib.sha256(alias.encode()).hexdigest()[:16]


class PytrioState:
    def __init__(self, service: WorkerService, options: PytrioOptions, clock: Callable[[], float] = time.time):
        self.service = service
        self.options = options
        self.clock = clock
        self.started = clock()
        self.tokens = ActorTokens(options.pytrio_token_ttl, clock)
        self.sessions: ClientSessions[Session] = ClientSessions(
            options.pytrio_max_sessions, options.pytrio_session_ttl, lambda: self.clock(), _unknown_session,
            cap_flag="--pytrio-max-sessions", ttl_flag="--pytrio-session-ttl", noun="service sessions",
            advice="end some ServiceClients")  # past the cap: 429, answered 409 by the Control plane
        self.training: dict[str, TrainingRun] = {}
        self.sampling: dict[str, OrderedDict[str, SamplingRun]] = {}  # tenant -> its runs, least recently used first
        self.temporary: dict[str, TemporaryWeights] = {}  # trio:// path -> expiry
        self.damaged: dict[str, tuple[str, str]] = {}  # training runs whose record was set aside at start
        self.journal = PytrioJournal(service.journal)
        self.answers = KeptAnswers(service.limits.max_result_bytes)  # kept event and sample answers, per key
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, work: Awaitable, what: str) -> None:
        """Run ``work`` in the background (held here until it ends; a failure is logged)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            self._tasks.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                logger.warning("pytrio: %s failed: %s", what, finished.exception())

        task.add_done_callback(done)

    # --- sessions -------------------------------------------------------------------------------------------

    def new_session(self, tenant: str, sdk_version: str) -> Session:
        now = self.clock()
        session = Session("ss_" + uuid.uuid4().hex[:20], tenant, sdk_version, now, now)
        return self.sessions.open(session.cuid, session, record=self.journal.session)

    def session(self, cuid: str, tenant: str) -> Session:
        return self.sessions.lookup(cuid, tenant)

    def sessions_of(self, tenant: str) -> list[Session]:
        return self.sessions.of(tenant)

    def training_cuids(self, session: Session) -> list[str]:
        """The cuids of the session's training runs, oldest first."""
        return list(self.sessions.leases(session.cuid, TRAINING_RUN))

    def sampling_cuids(self, session: Session) -> list[str]:
        """The cuids of the session's sampling runs, oldest first."""
        return list(self.sessions.leases(session.cuid, SAMPLING_RUN))

    async def close_session(self, session: Session, status: str) -> None:
        """Release everything the session leased: training runs (their adapters), sampling runs, tokens and its
        temporary sampler weights. Checkpoints on disk stay."""
        leases = self.sessions.close(session.cuid)
        self.journal.session_closed(session.cuid)
        session.status = status
        for cuid in leases.get(TRAINING_RUN, {}):
            run = self.training.get(cuid)
            if run is not None:
                await self.release_training(run, f"its service session {session.cuid} was closed")
        for cuid in leases.get(SAMPLING_RUN, {}):
            run = self.sampling.get(session.tenant, {}).get(cuid)
            if run is not None:
                self.release_sampling(run)
        for path in leases.get(TEMPORARY_WEIGHTS, {}):
            if path in self.temporary:
                self._drop_temporary(path)

    # --- training runs --------------------------------------------------------------------------------------

    def count_training(self, tenant: str) -> int:
        return sum(1 for r in self.training.values() if r.tenant == tenant)

    def add_training(self, run: TrainingRun, session: Session) -> TrainingRun:
        run.token, run.token_expires = self.tokens.mint(run.tenant, "training", run.cuid, session.cuid)
        self.save_training(run)
        self.training[run.cuid] = run
        self.sessions.lease(session.cuid, TRAINING_RUN, run.cuid)
        return run

    def save_training(self, run: TrainingRun) -> None:
        """Record the run as it is now (``--durability full``)."""
        self.journal.training_run(run, self.tokens.written(run.cuid))

    def renew(self, run: TrainingRun | SamplingRun) -> tuple[str, float]:
        """The run's token with a fresh expiry (recorded: a renewal after a restart mints a new token)."""
        token, expires = self.tokens.renew(run.cuid)
        if isinstance(run, TrainingRun):
            self.save_training(run)
        else:
            self.journal.sampling_run(run, self.tokens.written(run.cuid))
        return token, expires

    def training_run(self, cuid: str, tenant: str) -> TrainingRun:
        run = self.training.get(cuid)
        if run is None and self.damaged.get(cuid, ("",))[0] == tenant:
            raise WorkerError(410, "training_run_damaged", f"training_run: {cuid!r} could not be restored after the "
                                                           f"worker restarted: its record is damaged "
                                                           f"({self.damaged[cuid][1]}); it was moved to the "
                                                           "quarantine table of durable/state.db. Start a new "
                                                           "training run from its last checkpoint", "training_run_cuid")
        if run is None or run.tenant != tenant:
            raise WorkerError(404, "training_run_not_found", f"training_run: unknown training run {cuid!r} (it was "
                                                             "released, or the worker restarted)",
                              "training_run_cuid")
        run.last_seen = self.clock()
        return run

    def touch_session(self, session_cuid: str) -> None:
        session = self.sessions.get(session_cuid)
        if session is not None:
            session.last_seen = self.clock()

    async def release_training(self, run: TrainingRun, reason: str) -> None:
        """Forget the run: its token stops working, queued events fail, its adapter is dropped (in the tenant's lane,
        after the ops already queued there)."""
        self.training.pop(run.cuid, None)
        self.tokens.revoke(run.cuid)
        self.sessions.release(run.session_cuid, TRAINING_RUN, run.cuid)
        run.status = "ENDED"
        if run.events is not None:
            run.events.close(f"the training run was released: {reason}")
        if run.init != "none":
            try:
                await self.service.runs.delete(run.cuid, run.tenant)
            except WorkerError:
                pass  # it never got an adapter, or it is already gone
        self.journal.training_released(run.cuid)  # after its adapter: a crash between leaves no adapter unowned
        logger.info("pytrio: released training run %s (%s)", run.cuid, reason)

    # --- sampling runs --------------------------------------------------------------------------------------

    def add_sampling(self, run: SamplingRun, session: Session) -> SamplingRun:
        run.token, run.token_expires = self.tokens.mint(run.tenant, "sampling", run.cuid, session.cuid)
        self.journal.sampling_run(run, self.tokens.written(run.cuid))
        mine = self.sampling.setdefault(run.tenant, OrderedDict())
        mine[run.cuid] = run
        self.sessions.lease(session.cuid, SAMPLING_RUN, run.cuid)
        while len(mine) > self.options.pytrio_max_sampling_runs:  # this key's least recently used goes first
            self.release_sampling(next(iter(mine.values())))
        return run

    def sampling_run(self, cuid: str, tenant: str, use: bool = True) -> SamplingRun:
        run = self.sampling.get(tenant, {}).get(cuid)
        if run is None:
            raise WorkerError(404, "sampling_run_not_found", f"sampling_run: unknown sampling run {cuid!r} (sampling "
                                                             "runs idle for --pytrio-sampling-run-ttl, or beyond "
                                                             "--pytrio-max-sampling-runs per key, are released)",
                              "sampling_run_cuid")
        if use:
            run.last_used = self.clock()
            self.sampling[tenant].move_to_end(cuid)
        return run

    def sampling_of(self, session: Session) -> list[SamplingRun]:
        mine = self.sampling.get(session.tenant, {})
        return [mine[c] for c in self.sessions.leases(session.cuid, SAMPLING_RUN) if c in mine]

    def release_sampling(self, run: SamplingRun) -> None:
        mine = self.sampling.get(run.tenant, {})
        mine.pop(run.cuid, None)
        if not mine:
            self.sampling.pop(run.tenant, None)
        self.journal.sampling_released(run.cuid)
        self.tokens.revoke(run.cuid)
        self.sessions.release(run.session_cuid, SAMPLING_RUN, run.cuid)
        for request_id, task in run.samples.items():
            task.cancel()
            self.answers.drop(run.tenant, ("sample", run.cuid, request_id))
        self.service.samplers.drop(run.sampler_id, run.tenant)

    # --- temporary sampler weights --------------------------------------------------------------------------

    def keep_temporary(self, path: str, tenant: str, session_cuid: str, ttl: float) -> None:
        """Kept until ``ttl`` or until its session closes (saved after that: until ``ttl``)."""
        self.temporary[path] = TemporaryWeights(tenant, session_cuid, self.clock() + ttl)
        self.journal.temporary(path, self.temporary[path])
        self.sessions.lease(session_cuid, TEMPORARY_WEIGHTS, path)

    def _forget_temporary(self, path: str) -> None:
        weights = self.temporary.pop(path, None)
        if weights is not None:
            self.sessions.release(weights.session_cuid, TEMPORARY_WEIGHTS, path)
        self.journal.temporary_dropped(path)

    def _drop_temporary(self, path: str) -> None:
        self._forget_temporary(path)
        self.service.checkpoints.snapshots.pop(path)

    # --- collection -----------------------------------------------------------------------------------------

    async def sweep(self) -> None:
        """Release what expired: idle sessions, training runs whose client stopped, idle sampling runs,
        temporary weights past their TTL, and old event answers."""
        now = self.clock()
        options = self.options
        for path in [p for p, t in self.temporary.items() if t.expires <= now]:
            self._drop_temporary(path)
        for path in [p for p in self.temporary if p not in self.service.checkpoints.snapshots]:
            self._forget_temporary(path)  # evicted by the per-key snapshot limit already
        for runs in list(self.sampling.values()):
            for run in [r for r in runs.values() if now - r.last_used > options.pytrio_sampling_run_ttl]:
                self.release_sampling(run)
        for session in self.sessions.idle(now):
            logger.info("pytrio: closing service session %s, idle for %.0f s", session.cuid, now - session.last_seen)
            await self.close_session(session, "ENDED")
        for run in list(self.training.values()):
            busy = run.events is not None and run.events.pending() > 0
            if not busy and now - run.last_seen > options.pytrio_run_idle_ttl:
                await self.release_training(run, f"no heartbeat or event for {now - run.last_seen:.0f} s")
            elif run.events is not None:
                run.events.prune()
