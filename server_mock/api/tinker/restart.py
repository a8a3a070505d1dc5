"""The Tinker front end taken up again at start (``--durability full``), after the service has restored its runs,
samplers and requests (service/recovery.py calls ``restore`` as one of its ``recovery_hooks``).

From the records of ``api/tinker/durable.py`` and the ops and requests the service journaled with their Tinker
fields: sessions (counted as seen now), training models on their restored runs, each model's seq_id gate (a re-sent
seq_id gets its original future, the next one is past every recorded one), the futures of the ops and samples
accepted before the crash (finished ones answer at once, the ones queued again when they run, each with the answer
it would have had), the futures that created models, sampling sessions, and the (sampler, seq_id) pairs that
recognise a re-sent ``asample``.

What is not recorded comes back as "gone with the restart": a future id of the process before that names none of
these answers 410 (``futures.retrieve_future``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from server_mock.api.tinker.answers import Answer, converter, sample_answer, snapshot_sampler_id
from server_mock.api.tinker.durable import MODELS, SAMPLING, SESSIONS
from server_mock.api.tinker.state import Session, TinkerState
from server_mock.engine.jobs import job_result
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")


async def _answer(value: Any) -> Any:
    return value


async def restore(state: TinkerState) -> dict[str, int]:
    service = state.service
    journal = service.journal
    db = journal.db
    counts = {"tinker_sessions": 0, "tinker_models": 0, "tinker_futures": 0}
    for session_id, tenant, value in db.records(SESSIONS):
        session = Session(session_id, tenant, created=value.get("created", 0.0))
        session.user_metadata, session.display_name = value.get("user_metadata"), value.get("display_name")
        state.sessions[session_id] = session
        counts["tinker_sessions"] += 1
    for model_id, tenant, value in db.records(MODELS):
        session = state.sessions.get(value["session_id"])
        try:
            run = service.runs.get(value["run_id"], tenant)
        except WorkerError:
            run = None
        if session is None or run is None:
            logger.warning("tinker model %s not restored: its %s is gone", model_id,
                           "session" if session is None else "training run")
            db.delete_record(MODELS, model_id)
            continue
        labels = value.get("user_metadata")
        run.user_metadata = labels
        model = await state.register(session, model_id, run.run_id, run.base_model, labels)
        session.creations += 1
        state.add_creation(session, value["model_seq_id"], value["request_id"], model_id)
        state.futures.add(tenant, _answer(value["answer"]), value["request_id"])
        counts["tinker_models"] += 1
        for op in journal.ops(run.run_id):
            front = op.front
            if not front or front.get("protocol") != "tinker" or front.get("model_id") != model_id:
                continue
            model.gate.restore(front["seq_id"], op.request_id, op.body_hash)
            job = service.requests.get(op.request_id, tenant)
            if job is None:  # its result expired
                continue
            answer = Answer(front["answer"], front.get("params") or {})
            convert = converter(state, tenant, model, answer, op.request_id)
            if answer.kind == "snapshot":  # makes a sampler: only if the client asks for it again
                try:
                    state.add_session_sampler(session, service.samplers.get(snapshot_sampler_id(op.request_id),
                                                                             tenant).sampler_id)
                except WorkerError:
                    pass
                state.futures.add_lazy(tenant, lambda job=job, convert=convert: job_result(job, convert),
                                       op.request_id)
            else:
                state.futures.add_guarded(tenant, job_result(job, convert), op.request_id)
            counts["tinker_futures"] += 1
    for key, tenant, value in db.records(SAMPLING):
        session_id, _, seq = key.rpartition(":")
        session = state.sessions.get(session_id)
        try:
            sampler = service.samplers.get(value["sampler_id"], tenant)
        except WorkerError:
            continue
        if session is not None:
            state.add_sampling_session(session, int(seq), sampler.sampler_id)
            state.add_session_sampler(session, sampler.sampler_id)
            session.creations += 1
    for request_id, tenant, _sampler_id, front in journal.front_requests():
        if front.get("protocol") != "tinker":
            continue
        job = service.requests.get(request_id, tenant)
        if job is None:
            continue

        async def encoded(result: dict, front=front) -> bytes:
            return await asyncio.to_thread(sample_answer, result, front["include_prompt"], front["last_n"],
                                           front["topk"])

        state.futures.add_guarded(tenant, job_result(job, encoded), request_id)
        if front.get("dedupe"):
            key, sequence_ids, body_digest = front["dedupe"]
            state.samples.put(key, tenant, (request_id, sequence_ids, body_digest))
        counts["tinker_futures"] += 1
    return counts
