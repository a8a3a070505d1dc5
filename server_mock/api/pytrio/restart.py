"""The PyTRIO front end taken up again at start (``--durability full``), after the service has restored its runs,
samplers, snapshots and requests (service/recovery.py calls ``restore`` as one of its ``recovery_hooks``).

From the records of ``api/pytrio/durable.py`` and the ops and sample requests the service journaled with their
PyTRIO fields: service sessions, training runs on their restored service runs with their actor tokens (the ones
the SDK holds keep working), each run's event table (every event handed to the service answers from the service's
request: finished ones at once, the ones queued again when they run, each with the answer it would have had; the
events recorded with an answer answer it; those recorded with only their body run again, in index order, after
the rest), the index the run admits next, sampling runs with their tokens and the sample requests a retry must
find again, and temporary sampler weights.

Everything else the SDK asked for before the restart answers as after a release: 401 for a token no run holds,
404 for an event no longer known.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from pydantic import ValidationError as PydanticValidationError

from pytrio_compat.wire import LoraSpec
from server_mock.api.pytrio import event_wire as wire
from server_mock.api.pytrio import sampling, training
from server_mock.api.pytrio.actor import decode_event, msgpack_limits
from server_mock.api.pytrio.durable import EVENTS, SAMPLING, SESSIONS, TEMPORARY, TRAINING, unb64
from server_mock.api.pytrio.events import Event
from server_mock.api.pytrio.runs import new_events
from server_mock.api.pytrio.state import (
    SAMPLING_RUN,
    TEMPORARY_WEIGHTS,
    TRAINING_RUN,
    PytrioState,
    SamplingRun,
    Session,
    TemporaryWeights,
    TrainingRun,
)
from server_mock.api.pytrio.tokens import Grant
from server_mock.errors import WorkerError
from server_mock.service.journal import DAMAGED_ROW

logger = logging.getLogger("server_mock")


async def restore(state: PytrioState) -> dict[str, int]:
    db = state.journal.db
    now = state.clock()
    counts = {"pytrio_sessions": 0, "pytrio_training_runs": 0, "pytrio_events": 0, "pytrio_events_rerun": 0,
              "pytrio_sampling_runs": 0}
    for cuid, tenant, value in db.records(SESSIONS):
        try:
            state.sessions[cuid] = Session(cuid, tenant, value["sdk_version"], value["created"], now)
        except DAMAGED_ROW as exc:  # one damaged record never stops the worker starting
            _quarantine(db, SESSIONS, cuid, tenant, exc)
            continue
        counts["pytrio_sessions"] += 1
    for path, tenant, value in db.records(TEMPORARY):
        try:
            weights = TemporaryWeights(**value)
        except DAMAGED_ROW as exc:
            _quarantine(db, TEMPORARY, path, tenant, exc)
            continue
        if path in state.service.checkpoints.snapshots:
            state.temporary[path] = weights
            state.sessions.lease(weights.session_cuid, TEMPORARY_WEIGHTS, path)  # its session's, if still open
        else:
            state.journal.temporary_dropped(path)
    events = _events_by_run(db)
    for cuid, tenant, value in sorted(_readable(db, TRAINING), key=lambda r: r[2]["created"]):
        try:
            session = state.sessions.get(value["session"])
            if session is None:  # closed just before the crash: what it owned is released now
                await _drop_service_run(state, cuid, tenant)
                state.journal.training_released(cuid)
                continue
            run = TrainingRun(cuid=cuid, tenant=tenant, session_cuid=session.cuid, run_index=value["run_index"],
                              alias=value["alias"], model_id=value["model_id"], lora=LoraSpec(**value["lora"]),
                              source_uri=value["source_uri"], restore_optimizer=value["restore_optimizer"],
                              created=value["created"], last_seen=now, init=value["init"], status=value["status"])
            if not await _restore_training(state, run, value, events.get(cuid, {}), counts):
                continue
        except DAMAGED_ROW as exc:
            state.training.pop(cuid, None)
            _quarantine(db, TRAINING, cuid, tenant, exc)
            continue
        except Exception as exc:  # noqa: BLE001 - not the record's fault: kept for the next start
            state.training.pop(cuid, None)
            logger.error("pytrio training run %s not restored this time (kept in the journal): %s: %s", cuid,
                         type(exc).__name__, exc)
            continue
        state.sessions.lease(session.cuid, TRAINING_RUN, cuid)
        counts["pytrio_training_runs"] += 1
    for _source, cuid, tenant, reason, _row in db.quarantined(f"records:{TRAINING}"):
        state.damaged[cuid] = (tenant, reason)
    for cuid, tenant, value in sorted(_readable(db, SAMPLING), key=lambda r: r[2]["created"]):
        try:
            _restore_sampling(state, cuid, tenant, value, now, counts)
        except DAMAGED_ROW as exc:
            _quarantine(db, SAMPLING, cuid, tenant, exc)
    _restore_samples(state)
    return counts


def _readable(db, namespace: str) -> list[tuple[str, str, dict]]:
    """The records of ``namespace`` that are JSON objects with a creation time (the rest are quarantined)."""
    out = []
    for key, tenant, value in db.records(namespace):
        if isinstance(value, dict) and isinstance(value.get("created"), (int, float)):
            out.append((key, tenant, value))
        else:
            _quarantine(db, namespace, key, tenant, ValueError("not an object with a numeric 'created'"))
    return out


def _quarantine(db, namespace: str, key: str, tenant: str, exc: BaseException) -> None:
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    logger.error("state.db: PyTRIO record %s %r (tenant %s) cannot be restored: %s; moved to the quarantine table, "
                 "the rest is restored", namespace, key, tenant, reason)
    db.quarantine("records", (namespace, key), reason)


def _restore_sampling(state: PytrioState, cuid: str, tenant: str, value: dict, now: float,
                      counts: dict[str, int]) -> None:
    session = state.sessions.get(value["session"])
    try:
        state.service.samplers.get(value["sampler_id"], tenant)
    except WorkerError:
        session = None  # its sampler did not come back
    if session is None or not value["token"]:
        state.journal.sampling_released(cuid)
        return
    run = SamplingRun(cuid=cuid, tenant=tenant, session_cuid=session.cuid, run_index=value["run_index"],
                      alias=value["alias"], model_id=value["model_id"], source_uri=value["source_uri"],
                      sampler_id=value["sampler_id"], created=value["created"], last_used=now)
    digest, expires = value["token"]
    state.tokens.restore(digest, Grant(tenant, "sampling", cuid, session.cuid, expires))
    run.token_expires = expires
    state.sampling.setdefault(tenant, OrderedDict())[cuid] = run
    state.sessions.lease(session.cuid, SAMPLING_RUN, cuid)
    counts["pytrio_sampling_runs"] += 1


async def _drop_service_run(state: PytrioState, cuid: str, tenant: str) -> None:
    try:
        await state.service.runs.delete(cuid, tenant)
    except WorkerError:
        pass  # it never got an adapter


def _events_by_run(db) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for key, tenant, value in db.records(EVENTS):
        run_cuid, _, event_id = key.partition(":")
        if not (isinstance(value, dict) and isinstance(value.get("index"), int) and isinstance(value.get("type"), str)
                and isinstance(value.get("digest"), str) and "answer" in value and "body" in value):
            _quarantine(db, EVENTS, key, tenant, ValueError("not an event record (index, type, digest, answer, body)"))
            continue
        out.setdefault(run_cuid, {})[event_id] = value
    return out


async def _restore_training(state: PytrioState, run: TrainingRun, value: dict, recorded: dict[str, dict],
                            counts: dict[str, int]) -> bool:
    service = state.service
    try:
        service_run = service.runs.get(run.cuid, run.tenant)
    except WorkerError:
        service_run = None
    has_adapter = service_run is not None
    if run.init == "ready" and not has_adapter:  # its state did not come back (logged by the service)
        logger.error("pytrio training run %s not restored: its adapter is gone", run.cuid)
        state.journal.training_released(run.cuid)
        return False
    if run.init == "pending":  # its init_run runs again, unless its adapter was made before the crash
        run.init, run.status = ("ready", "ACTIVE") if has_adapter else ("none", run.status)
        if has_adapter:
            run.lora = service_run.spec
    if value["token"]:
        digest, expires = value["token"]
        state.tokens.restore(digest, Grant(run.tenant, "training", run.cuid, run.session_cuid, expires))
        run.token_expires = expires
    run.events = table = new_events(state, run)
    state.training[run.cuid] = run
    restored: list[Event] = []
    for op in service.journal.ops(run.cuid) if has_adapter else []:
        front = op.front
        if not front or front.get("protocol") != "pytrio" or front.get("run") != run.cuid:
            continue
        event = Event(front["event_id"], front["type"], front["index"], bytes.fromhex(front["digest"]))
        job = service.requests.get(op.request_id, run.tenant)
        if job is None:  # its result expired: the event is past its TTL too; only its index counts
            table.next_index = max(table.next_index, event.index + 1)
            continue
        table.watch(event, job, training.finisher(state, run, event, front["answer"]))  # ended: answers at once
        restored.append(event)
    known = {e.event_id for e in restored}
    rerun: list[tuple[Event, bytes]] = []
    for event_id, rec in recorded.items():
        if event_id in known:
            continue
        event = Event(event_id, rec["type"], rec["index"], bytes.fromhex(rec["digest"]), recorded=True)
        answer, body = unb64(rec["answer"]), unb64(rec["body"])
        if answer is not None:
            event.finish(answer)
        elif rec["type"] == "trainer.init_run" and has_adapter:
            event.finish(wire.succeeded(event_id, rec["type"], wire.EmptyResultOut(), wire.UsageOut()))
        elif body is not None:
            rerun.append((event, body))
            continue
        else:
            continue
        restored.append(event)
    for event in sorted(restored, key=lambda e: e.index):
        table.record(event, advance=False)
        table.next_index = max(table.next_index, event.index + 1)
    counts["pytrio_events"] += len(restored)
    for event, body in sorted(rerun, key=lambda item: item[0].index):
        if event.index < table.next_index:  # a later event was handed over already: this one cannot run now
            logger.warning("pytrio event %s of run %s not run again: its index %d is behind %d", event.event_id,
                           run.cuid, event.index, table.next_index)
            continue
        if await _admit_again(state, run, event, body):
            counts["pytrio_events_rerun"] += 1
    if run.init != value["init"]:  # its init_run ended before the crash, or runs again
        state.save_training(run)
    return True


async def _admit_again(state: PytrioState, run: TrainingRun, event: Event, body: bytes) -> bool:
    """Queue again an event recorded before it could be handed to the service (it runs as it would have)."""
    try:
        envelope = await asyncio.to_thread(decode_event, body, msgpack_limits(state))
        payload = await asyncio.to_thread(wire.parse_payload, envelope)
    except (WorkerError, PydanticValidationError) as exc:  # the limits changed across the restart
        event.fail("invalid_payload", f"the event could not be read again after a restart: {exc}")
        run.events.record(event)
        state.journal.event(run, event)
        return False
    if event.type == "trainer.init_run":
        run.init = "pending"
    event.payload = payload
    event.ended = None
    run.events.next_index = event.index
    run.events.admit(event)
    return True


def _restore_samples(state: PytrioState) -> None:
    """The sample requests accepted before the restart, so that a retry (same ``request_id``) gets their answer."""
    service = state.service
    for request_id, tenant, _sampler_id, front in service.journal.front_requests():
        if front.get("protocol") != "pytrio":
            continue
        run = state.sampling.get(tenant, {}).get(front["sampling_run"])
        job = service.requests.get(request_id, tenant)
        if run is not None and job is not None:
            sampling.remember(run, front["shape"], job)

