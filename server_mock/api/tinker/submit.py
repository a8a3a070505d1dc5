"""The ordered hand-over of a Tinker training model's operations to the service.

Every operation on a training model (forward_backward, optim_step, saves, loads) is admitted by the model's
``SeqGate`` in Tinker's ``seq_id`` order and then handed to the service as the run's next op
(``Runs.submit(seq_id=None)``): the gate orders, the service executes, and nothing invents a native seq_id.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from server_mock.api import bodies
from server_mock.api.tinker import schemas
from server_mock.api.tinker.answers import Answer, converter
from server_mock.api.tinker.endpoint import digest, read_body
from server_mock.api.tinker.futures import raise_
from server_mock.api.tinker.holding import Slim
from server_mock.api.tinker.state import TinkerModel, TinkerState
from server_mock.engine.jobs import job_result
from server_mock.errors import WorkerError, bad_request, raising


def submit_op(state: TinkerState, model: TinkerModel, tenant: str, payload, body_digest: str,
              convert: Callable[[dict], Any] | Answer | None, request_id: str | None = None,
              seq_id: int = 0) -> Awaitable[Any]:
    """Hand one op to the service, after its predecessors; the awaitable of its result.

    ``payload``: the op, its ``PreparedOp``, why preparing it failed, or a function giving one of those.
    ``convert``: how its result becomes the answer; an ``Answer`` is journaled with the op (with the Tinker
    ``seq_id`` and ``request_id``, the future's id, which the service's request then has too), so that the answer
    is made again after a restart. An invalid op's awaitable raises its error. Only a full queue (429) raises here.
    """
    answer = convert if isinstance(convert, Answer) else None
    front = answer.front(model.model_id, seq_id) if answer is not None else None
    try:
        work = payload() if callable(payload) else payload
        admission = state.service.runs.submit(model.run_id, work, tenant, seq_id=None, body_hash=body_digest,
                                              request_id=request_id if answer else None, front=front)
    except WorkerError as exc:
        if exc.status == 429:
            raise
        return raise_(exc)
    except Exception as exc:  # noqa: BLE001
        return raise_(exc)
    if answer is not None:
        convert = converter(state, tenant, model, answer, admission.request_id)
    return job_result(admission.job, convert)


def gated(state: TinkerState, tenant: str, model: TinkerModel, seq_id: Any, body_digest: str, payload,
          convert: Callable[[dict], Any] | Answer | None, size: int,
          reload: tuple[int, Callable[[], Any]] | None = None) -> dict:
    """Admit one operation of ``model`` in seq_id order; its future's id. ``size``: the bytes it keeps
    while it waits for an earlier seq_id; ``reload``: a smaller form to keep instead, as (its size, a
    function run in a thread that gives back the payload)."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise bad_request("seq_id", "required: an integer")
    model.last_request = time.time()  # TrainingRun.last_request_time (REST)
    request_id = state.futures.new_id()  # the future's id, and its service request's

    def submitter(payload) -> Callable[[], Awaitable[Any]]:
        return lambda: submit_op(state, model, tenant, payload, body_digest, convert, request_id, seq_id)

    slim = None
    if reload is not None:
        reload_size, load = reload
        slim = Slim(reload_size, lambda: submitter(load()))
    admitted = model.gate.admit(  # request_id for a new seq_id, the original one for a re-send
        seq_id, body_digest, submitter(payload), lambda work: state.futures.add_guarded(tenant, work, request_id),
        lambda message: state.futures.add_failed(tenant, bad_request("seq_id", message, code="seq_id_conflict")),
        size, slim)
    return {"request_id": admitted, "model_id": model.model_id}


async def read_op(state: TinkerState, request: Request, tenant: str, model: type[schemas.TinkerBody]
                  ) -> tuple[Any, int]:
    """The body of one operation of a training model, and its size. A body that is refused but names one of the
    caller's models and a seq_id uses that seq_id up with a failed future, as a refused forward_backward does, so
    the model's later operations are not held back waiting for it."""
    raw = await read_body(request, state.json_limit)
    try:
        return await bodies.parse_raw(request, model, raw, state.json_limit, schemas.parse), len(raw)
    except WorkerError as exc:
        refusal = exc
        if refusal.status == 400:
            try:
                envelope = await bodies.parse_raw(request, schemas.ModelOp, raw, state.json_limit, schemas.parse)
                target = state.model(envelope.model_id, tenant)
                gated(state, tenant, target, envelope.seq_id, digest(raw), raising(refusal), None, 0)
            except WorkerError:
                pass  # nothing to use up
        raise
