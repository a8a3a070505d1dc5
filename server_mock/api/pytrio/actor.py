"""Actor routes of a training run: submit an event, poll it, and the client's heartbeat.

A submit is answered at once (the SDK allows 30 s and re-sends the same bytes when it times out): the body is
decoded within bounds, the event checked against the run's table and either refused as a failed event, answered
from the table (a re-sent event), or admitted to run in index order. Only bodies the SDK never sends (not a
decodable event) get an HTTP error, because any other error status on submit breaks the SDK's training client for
good. A poll holds until the event ends or ``Prefer: wait=N`` nearly runs out.

Under ``--durability full`` an event is acknowledged only once a restart cannot lose it: a ``trainer.init_run``
once its body is recorded; any other event once its op is journaled by the service (or it has ended), which
takes the time to check its datums, or, past ``--pytrio-ack-wait`` seconds (events queued behind a slow init),
once its body is recorded to run again after a restart. A failed answer is recorded before it is sent.
Records are written in a worker thread, never on the event loop.
An envelope holds only the keys the SDK sends (``ENVELOPE_KEYS``, ``METADATA_KEYS``): any other is refused (400
naming it), so a body cannot carry bytes that nobody reads into the journal.
"""

from __future__ import annotations

import asyncio
import hashlib
import re

from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request
from starlette.responses import Response

from server_mock.api import bodies
from server_mock.api.body_budget import TENANT_SCOPE_KEY
from server_mock.api.long_polls import held_poll
from server_mock.api.pytrio import event_wire as wire
from server_mock.api.pytrio.endpoint import first_error
from server_mock.api.pytrio.events import MAX_WAITING, Event
from server_mock.api.pytrio.msgpack_codec import MEDIA_TYPE, MsgpackError, MsgpackLimits, decode
from server_mock.api.pytrio.state import PytrioState, TrainingRun
from server_mock.api.pytrio.tokens import Grant
from server_mock.errors import WorkerError
from server_mock.service.validation import check_datum_count

POLL_HOLD_CAP = 50.0  # seconds; the SDK's poll timeout is Prefer's wait (65 s by default)
POLL_MARGIN = 5.0
HEARTBEAT_MS = 60_000


def msgpack_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status_code=status, media_type=MEDIA_TYPE)


def caller(state: PytrioState, request: Request, kind: str) -> Grant:
    grant = state.tokens.resolve(request.headers.get("authorization"))
    request.scope[TENANT_SCOPE_KEY] = grant.tenant  # its body is charged to its key (api/body_budget.py)
    if grant.kind != kind:
        raise WorkerError(404, f"{kind}_run_not_found", f"this actor token opens a {grant.kind} run, not a {kind} run")
    return grant


def training_run(state: PytrioState, grant: Grant, cuid: str | None = None) -> TrainingRun:
    run = state.training.get(grant.run_cuid)
    if run is None or run.tenant != grant.tenant or (cuid is not None and cuid != run.cuid):
        raise WorkerError(404, "training_run_not_found", f"training_run: {cuid or grant.run_cuid!r} is not the run "
                                                         "this actor token opens", "metadata.run_id")
    run.last_seen = state.clock()
    state.touch_session(run.session_cuid)
    return run


def msgpack_limits(state: PytrioState) -> MsgpackLimits:
    limits = state.service.limits
    tokens = max(limits.max_seq_len, limits.max_tokens_per_request)
    return MsgpackLimits(max_body_bytes=limits.max_body_bytes, max_items=max(1 << 16, 8 * tokens),
                         max_array_len=max(tokens, 4096))


# The keys of an event envelope and of its metadata (what the SDK sends, pytrio 0.2.9); any other key is refused,
# so that nothing nobody reads is decoded, kept or journaled.
ENVELOPE_KEYS = ("version", "event_id", "type", "metadata", "payload")
METADATA_KEYS = ("index", "step", "timestamp", "sdk", "sdk_version", "run_id")


def decode_event(raw: bytes, limits: MsgpackLimits) -> wire.EventEnvelopeIn:
    """A submit body as an event envelope; 400 naming the problem for anything that is not one."""
    try:
        data = decode(raw, limits)
    except MsgpackError as exc:
        raise WorkerError(413 if exc.code == "body_too_large" else 400, exc.code, str(exc), "body") from None
    if not isinstance(data, dict):
        raise WorkerError(400, "invalid_event", "body: an event is a msgpack map", "body")
    for where, keys, known in (("", data, ENVELOPE_KEYS),
                               ("metadata.", data.get("metadata") if isinstance(data.get("metadata"), dict) else {},
                                METADATA_KEYS)):
        unknown = [key for key in keys if key not in known]
        if unknown:
            name = f"{where}{str(unknown[0])[:64]}"
            part = f"event {where[:-1]}" if where else "event"
            raise WorkerError(400, "invalid_event", f"{name}: unknown key in the {part} (it holds only "
                                                    f"{', '.join(known)}); send only these", name)
    try:
        return wire.EventEnvelopeIn.model_validate(data)
    except PydanticValidationError as exc:
        loc, message = first_error(exc)
        raise WorkerError(400, "invalid_event", message, loc) from None


def refusal(envelope: wire.EventEnvelopeIn, payload, run: TrainingRun) -> tuple[str, str] | None:
    """Why a well-formed event cannot run on this run now (answered as a failed event), or None."""
    kind = envelope.type
    if kind == "trainer.init_run":
        if run.init != "none":
            return "already_initialized", "the run already received trainer.init_run"
        if payload.base_model != run.model_id:
            return "model_mismatch", (f"payload.base_model: {payload.base_model!r} is not this run's model_id "
                                      f"{run.model_id!r}")
        return None
    if run.init == "none":
        return "run_not_initialized", "send trainer.init_run first"
    return None


async def submit_event(state: PytrioState, request: Request):
    grant = caller(state, request, "training")
    run = training_run(state, grant)
    raw = await bodies.read_body(request, state.service.limits.max_body_bytes)
    limits = msgpack_limits(state)
    big = len(raw) > bodies.BIG_BODY_BYTES
    if big:  # decoded within the worker's parse budget (--max-parsing-bytes), as large JSON bodies are parsed
        async with bodies.parsing(request, len(raw)):
            envelope = await asyncio.to_thread(decode_event, raw, limits)
    else:
        envelope = decode_event(raw, limits)
    training_run(state, grant, envelope.metadata.run_id)
    digest = hashlib.sha256(raw).digest()
    table = run.events
    async with table.admitting:
        event = table.get(envelope.event_id)
        if event is not None:  # a re-sent event: its status now, never a second run
            if event.digest != digest:
                raise WorkerError(409, "event_exists", f"event_id: {envelope.event_id} was already submitted with a "
                                                       "different body", "event_id")
            return await acknowledged(state, run, event, raw)
        event = Event(envelope.event_id, envelope.type, envelope.metadata.index, digest)
        if envelope.metadata.index != table.next_index:
            event.fail("out_of_order", f"metadata.index: expected {table.next_index}, got "
                                       f"{envelope.metadata.index} (events of a run are submitted in order)")
            table.record(event, advance=False)
            return msgpack_response(event.answer)
        if table.waiting() >= MAX_WAITING:  # behind an init that is slow to finish; the index stays free
            event.fail("too_many_queued_events", f"{MAX_WAITING} events of this run wait for the ones before them "
                                                 "to start; send this one again once they have")
            table.record(event, advance=False)
            return msgpack_response(event.answer)
        data = envelope.payload.get("data")
        try:  # counted before a datum is parsed: each costs pydantic and numpy work off the event loop
            check_datum_count(len(data) if isinstance(data, list) else 0, state.service.limits, "payload.data")
        except WorkerError as exc:
            event.fail(exc.code, exc.message)
            return await answered(state, run, event)
        try:
            payload = await asyncio.to_thread(wire.parse_payload, envelope) if big else wire.parse_payload(envelope)
        except PydanticValidationError as exc:
            event.fail("invalid_payload", first_error(exc, "payload")[1])
            return await answered(state, run, event)
        why = refusal(envelope, payload, run)
        if why is not None:
            event.fail(*why)
            return await answered(state, run, event)
        if envelope.type == "trainer.init_run":
            run.init = "pending"
            await asyncio.to_thread(state.save_training, run)  # journal writes off the event loop
            await asyncio.to_thread(state.journal.event, run, event, raw)
            event.taken.set()  # recorded: runs again after a restart
        event.payload = payload
        table.admit(event)
    return await acknowledged(state, run, event, raw)


async def acknowledged(state: PytrioState, run: TrainingRun, event: Event, raw: bytes) -> Response:
    """The event's status, once a restart cannot lose it (``--durability full``; see the module docstring)."""
    if state.journal.on and not event.taken.is_set():
        if not await event.wait(state.options.pytrio_ack_wait, until=event.taken) and not event.recorded:
            # still queued: recorded to run again after a restart
            await asyncio.to_thread(state.journal.event, run, event, raw)
            event.taken.set()
    return msgpack_response(event.current())


async def answered(state: PytrioState, run: TrainingRun, event: Event) -> Response:
    """A well-formed event refused at once: it uses up its index, and its failed answer is recorded first."""
    run.events.record(event)
    await asyncio.to_thread(state.journal.event, run, event)
    return msgpack_response(event.answer)


def hold_seconds(prefer: str | None) -> float:
    """How long a poll may wait: the client waits ``Prefer: wait=N`` seconds (also its HTTP timeout)."""
    match = re.search(r"(?:^|[;,\s])wait\s*=\s*(\d{1,6})", prefer or "")
    if match is None:
        return 0.0
    return max(0.0, min(POLL_HOLD_CAP, float(match.group(1)) - POLL_MARGIN))


async def get_event(state: PytrioState, request: Request):
    grant = caller(state, request, "training")
    run = training_run(state, grant)
    event_id = request.path_params["event_id"]
    event = run.events.get(event_id) if len(event_id) <= 64 else None
    if event is None:
        raise WorkerError(404, "event_not_found", f"event_id: no event {event_id[:64]!r} on this run (never "
                                                  f"submitted, or ended more than --pytrio-event-ttl ago)", "event_id")
    hold = hold_seconds(request.headers.get("prefer"))
    if hold > 0:  # one of the key's few held polls (api/long_polls.py): ended early, it answers the status now
        await held_poll(request, grant.tenant, event.wait(hold))
    return msgpack_response(event.current())


async def heartbeat(state: PytrioState, request: Request):
    grant = state.tokens.resolve(request.headers.get("authorization"))
    await bodies.read_body(request, 4096)
    if grant.kind == "training":
        training_run(state, grant)
    else:
        state.touch_session(grant.session_cuid)
    return {"heartbeat_ms": HEARTBEAT_MS}

