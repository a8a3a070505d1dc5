"""What the Tinker API remembers between requests: sessions, training models, sampling sessions,
futures, and the bounds on all of them.

What a session holds is its leases (service/sessions.py), of four kinds: ``CREATION`` (model_seq_id -> the future
that creates its model and the model's id), ``MODEL`` (its registered training models, deleted when it finishes),
``SAMPLING_SESSION`` (sampling_session_seq_id -> sampler) and ``SAMPLER`` (its sampling clients, newest last: the
most recent ``max_samplers``, whose samples may be recorded for stable_reinforce). Creations and sampling sessions
are leased by (session, seq_id).

Identifiers:
  session       ``sess-<hex>``; a session's training models are deleted when it finishes
  model_id      ``<session_id>:train:<model_seq_id>`` (the client derives this form itself)
  request_id    ``tk-<hex>``, a future polled with ``retrieve_future``
  sampler       the service's sampler id is the ``sampling_session_id``
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from server_mock.api.bodies import json_limit, tensor_limit
from server_mock.api.tinker.durable import TinkerJournal
from server_mock.api.tinker.futures import Futures
from server_mock.api.tinker.gate import SeqGate
from server_mock.api.tinker.holding import HeldBytes
from server_mock.api.tinker.proto.decode import ElementBudget
from server_mock.config import TinkerOptions
from server_mock.errors import WorkerError
from server_mock.service.quotas import TenantLRU
from server_mock.service.samplers import ReusedSamplers
from server_mock.service.sessions import ClientSessions
from server_mock.service.worker import WorkerService

logger = logging.getLogger("server_mock")

# the other bounds are flags (config.TinkerOptions: sessions, idle timeout, seq_id look-ahead, waiting bytes)
ELEMENTS_PER_TOKEN = 8  # a forward_backward request's tensors may declare 8 x max_tokens_per_request elements

# what a session leases (ClientSessions kinds)
CREATION, MODEL, SAMPLING_SESSION, SAMPLER = "creation", "model", "sampling_session", "sampler"


@dataclass
class Session:
    session_id: str
    tenant: str
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    creations: int = 0  # models and sampling sessions it made, for --tinker-max-creations
    user_metadata: dict[str, str] | None = None  # create_session's (ServiceClient(user_metadata=...))
    display_name: str | None = None


@dataclass
class TinkerModel:
    model_id: str
    run_id: str
    tenant: str
    session_id: str
    base_model: str
    gate: SeqGate
    user_metadata: dict[str, str] | None = None  # create_model's (the cookbook keeps its renderer name there)
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)


def _unknown_session(session_id: str) -> WorkerError:
    return WorkerError(404, "session_not_found", f"session_id: unknown session {session_id!r} (the worker may have "
                                                 "restarted)", "session_id")


class TinkerState:
    def __init__(self, service: WorkerService, options: TinkerOptions | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.service = service
        self.options = options = options or TinkerOptions()
        self.clock = clock  # when a session was last seen, and when it expires
        limits = service.limits
        self.json_limit = json_limit(limits)  # every JSON body
        self.tensor_limit = tensor_limit(limits)  # forward_backward's protobuf body
        journal = getattr(service, "journal", None)  # --durability full: sessions and models recorded
        self.futures = Futures(ttl=service.requests.result_ttl, max_bytes=limits.max_result_bytes,
                               durable=journal is not None)
        self.journal = TinkerJournal(journal)
        self.held = HeldBytes(options.tinker_waiting_bodies_per_session * limits.max_body_bytes,
                              options.tinker_waiting_bodies * limits.max_body_bytes)
        self.sessions: ClientSessions[Session] = ClientSessions(
            options.tinker_max_sessions, options.tinker_session_ttl, lambda: self.clock(), _unknown_session,
            cap_flag="--tinker-max-sessions", ttl_flag="--tinker-session-ttl",
            advice="close some (ServiceClient.close)")
        self.models: dict[str, TinkerModel] = {}
        # "sampler:seq_id" -> (request id, sequence ids, body digest), to answer re-sent asample requests; per tenant
        self.samples: TenantLRU[tuple[str, list[str], str]] = TenantLRU(options.tinker_sample_ids)
        # samplers for asample calls that name no sampling session, the most recent per key
        self.implicit = ReusedSamplers(service.samplers, options.tinker_implicit_samplers)
        self.rate_held: Counter[str] = Counter()  # samples held for their key's budget

    def element_budget(self) -> ElementBudget:
        tokens = self.service.limits.max_tokens_per_request
        return ElementBudget(ELEMENTS_PER_TOKEN * tokens,
                             f"{ELEMENTS_PER_TOKEN} x limit max_tokens_per_request={tokens}", max_tokens=tokens,
                             max_datums=self.service.limits.max_datums_per_request)

    # -- sessions and models ---------------------------------------------------------------------------

    def new_session(self, session_id: str, tenant: str) -> Session:
        now = self.clock()
        return self.sessions.open(session_id, Session(session_id, tenant, created=now, last_seen=now))

    def record_session(self, session: Session) -> None:
        """Before the client gets the session's id (``--durability full``)."""
        self.journal.session_created(session)

    def session(self, session_id: str, tenant: str) -> Session:
        return self.sessions.lookup(session_id, tenant)

    def count_creation(self, session: Session, what: str) -> None:
        if session.creations >= self.options.tinker_max_creations:
            raise WorkerError(429, "too_many_creations",
                              f"{what}: this session already created {session.creations} models and sampling "
                              f"sessions (limit {self.options.tinker_max_creations}, --tinker-max-creations); start "
                              "a new session", what)
        session.creations += 1

    def creation(self, session: Session, model_seq_id: int) -> tuple[str, str] | None:
        """(request id, model id) of the session's ``model_seq_id`` if it was asked for already."""
        return self.sessions.leases(session.session_id, CREATION).get((session.session_id, model_seq_id))

    def add_creation(self, session: Session, model_seq_id: int, request_id: str, model_id: str) -> None:
        self.sessions.lease(session.session_id, CREATION, (session.session_id, model_seq_id), (request_id, model_id))

    def sampling_session(self, session: Session, seq_id: int) -> str | None:
        """The sampler of the session's ``sampling_session_seq_id`` if it was made already."""
        return self.sessions.leases(session.session_id, SAMPLING_SESSION).get((session.session_id, seq_id))

    def add_sampling_session(self, session: Session, seq_id: int, sampler_id: str) -> None:
        self.sessions.lease(session.session_id, SAMPLING_SESSION, (session.session_id, seq_id), sampler_id)

    def session_runs(self, session_id: str) -> list[str]:
        """The service runs of the session's training models, oldest first."""
        return [self.models[m].run_id for m in self.sessions.leases(session_id, MODEL) if m in self.models]

    def session_samplers(self, session_id: str) -> list[str]:
        return list(self.sessions.leases(session_id, SAMPLER))

    def model(self, model_id: str, tenant: str) -> TinkerModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            raise WorkerError(404, "model_not_found", f"model_id: unknown model {model_id!r} (it was never created "
                                                      "here, its session finished, or the worker restarted)",
                              "model_id")
        return model

    async def register(self, session: Session, model_id: str, run_id: str, base_model: str,
                       user_metadata: dict[str, str] | None = None,
                       created_by: tuple[int, str, dict] | None = None) -> TinkerModel:
        """A training model on run ``run_id``; ``created_by``: (model_seq_id, the future's id, its answer) of the
        request that made it, recorded (``--durability full``) before that future finishes."""
        if self.sessions.get(session.session_id) is not session:  # it finished while the model was made
            await self._delete_run(run_id, session.tenant)
            raise WorkerError(404, "session_not_found", f"session_id: session {session.session_id!r} has finished")
        gate = SeqGate(max_ahead=self.options.tinker_max_seq_ahead, held=self.held, owner=session.session_id,
                       paused=self.futures.set_paused)
        model = TinkerModel(model_id, run_id, session.tenant, session.session_id, base_model, gate, user_metadata)
        if created_by is not None:
            self.journal.model_registered(model, *created_by)
        self.models[model_id] = model
        self.sessions.lease(session.session_id, MODEL, model_id)
        return model

    async def finish(self, session: Session) -> None:
        """End a session: its training models are deleted (their checkpoints stay); its creations, sampling sessions
        and samplers are no longer its."""
        leases = self.sessions.close(session.session_id)
        self.journal.session_finished(session.session_id)
        for model_id in leases.get(MODEL, {}):
            model = self.models.pop(model_id, None)
            if model is not None:
                model.gate.close(f"model_id: the session of {model_id!r} finished")
                await self._delete_run(model.run_id, session.tenant)
        self.service.stability.drop_scope(session.tenant, session.session_id)

    async def expire(self) -> None:
        """Finish the sessions whose client stopped sending heartbeats (every 10 s while it runs) for longer than
        --tinker-session-ttl: their training models are deleted, which frees their --max-adapters slots."""
        for session in self.sessions.idle():
            logger.info("tinker: session %s sent no heartbeat for %.0fs; finishing it", session.session_id,
                        self.sessions.ttl)
            await self.finish(session)

    async def _delete_run(self, run_id: str, tenant: str) -> None:
        try:
            await self.service.runs.delete(run_id, tenant)
        except WorkerError:
            pass

    def add_session_sampler(self, session: Session, sampler_id: str) -> None:
        """A sampling client made in ``session``: its samples may be recorded for stable_reinforce (the service
        keeps at most max_samplers of a key's samplers anyway, so the session keeps its newest that many)."""
        if self.sessions.get(session.session_id) is not session:
            return
        self.sessions.lease(session.session_id, SAMPLER, sampler_id)
        mine = self.sessions.leases(session.session_id, SAMPLER)
        while len(mine) > self.service.limits.max_samplers:
            self.sessions.release(session.session_id, SAMPLER, next(iter(mine)))

    def sampler_session(self, sampler_id: str) -> str | None:
        """The open session a sampler was made in (the scope its recorded samples go under), if any."""
        return self.sessions.holder(SAMPLER, sampler_id)
