"""Tinker routes that train a model: ``forward_backward`` (a protobuf body) and ``optim_step``, and
the seq_id-ordered hand-over to the service that every training-model operation goes through.

A forward_backward body is parsed, checked and turned into the service's op in a worker thread, so
the event loop never decodes, copies or base64-encodes tensors. A request that has to wait for an
earlier seq_id keeps only its body, the smaller form, and is decoded again in a thread when its turn
comes. Results are encoded to protobuf in a thread too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pytrio_compat.wire import AdamParams, ForwardOp, OptimStepOp, WireDatum, WireTensor
from server_mock.api.tinker.endpoint import digest, field, read_body, read_json_sized
from server_mock.api.tinker.futures import job_result, raise_
from server_mock.api.tinker.holding import Slim
from server_mock.api.tinker.paths import tinker_metrics
from server_mock.api.tinker.proto import decode as proto
from server_mock.api.tinker.proto import encode as results
from server_mock.api.tinker.state import TinkerModel, TinkerState
from server_mock.errors import WorkerError, bad_request
from server_mock.service.ops import DATUM_OVERHEAD_BYTES, PreparedOp, prepare_forward


def submit_op(state: TinkerState, model: TinkerModel, tenant: str, payload, body_digest: str,
              convert: Callable[[dict], Any] | None) -> Awaitable[Any]:
    """Hand one op to the service, after its predecessors; the awaitable of its result.

    An invalid op's awaitable raises its error. Only a full queue (429) raises here.
    """
    service = state.service
    try:
        run = service.get_run(model.run_id, tenant)
        work = payload() if callable(payload) else payload  # a payload, a PreparedOp, or why preparing failed
        accepted = service.submit_prepared(model.run_id, run.last_seq + 1, work, body_digest, tenant)
        job = service.requests.get(accepted.request_id, tenant)
    except WorkerError as exc:
        if exc.status == 429:
            raise
        return raise_(exc)
    except Exception as exc:  # noqa: BLE001
        return raise_(exc)
    return job_result(job, convert)


def gated(state: TinkerState, tenant: str, model: TinkerModel, seq_id: Any, body_digest: str, payload,
          convert: Callable[[dict], Any] | None, size: int,
          reload: tuple[int, Callable[[], Any]] | None = None) -> dict:
    """Admit one operation of ``model`` in seq_id order; its future's id. ``size``: the bytes it keeps
    while it waits for an earlier seq_id; ``reload``: a smaller form to keep instead, as (its size, a
    function run in a thread that gives back the payload)."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise bad_request("seq_id", "required: an integer")

    def submitter(payload) -> Callable[[], Awaitable[Any]]:
        return lambda: submit_op(state, model, tenant, payload, body_digest, convert)

    slim = None
    if reload is not None:
        reload_size, load = reload
        slim = Slim(reload_size, lambda: submitter(load()))
    request_id = model.gate.admit(
        seq_id, body_digest, submitter(payload), lambda work: state.futures.add_guarded(tenant, work),
        lambda message: state.futures.add_failed(tenant, bad_request("seq_id", message, code="seq_id_conflict")),
        size, slim)
    return {"request_id": request_id, "model_id": model.model_id}


# --- forward_backward ---------------------------------------------------------------------------------


@dataclass
class DecodedForward:
    model_id: str
    seq_id: int
    digest: str
    op: ForwardOp | None = None
    error: proto.ProtoError | None = None
    size: int = 0  # of the op in the service's base64 form


def decode_forward(raw: bytes, budget: proto.ElementBudget) -> DecodedForward:
    """Runs in a thread: the checked op of a ForwardBackwardRequest body, or why it is refused.

    A body that is not a ForwardBackwardRequest at all raises; one that is, but carries bad data,
    comes back with ``error`` set, so its seq_id can still be used up in order."""
    message = proto.parse_forward_backward_request(raw)
    out = DecodedForward(message.model_id, message.seq_id, digest(raw))
    try:
        req = proto.decode_forward_backward_request(message, budget)
        data = [WireDatum(tokens=WireTensor.from_array(d.tokens),
                          loss_fn_inputs={k: WireTensor.from_array(v) for k, v in d.loss_fn_inputs.items()})
                for d in req.data]
    except proto.ProtoError as exc:
        out.error = exc
        return out
    out.op = ForwardOp(op="forward" if req.forward_only else "forward_backward", loss_fn=req.loss_fn,
                       loss_fn_config=req.loss_fn_config, data=data)
    out.size = sum(DATUM_OVERHEAD_BYTES + len(d.tokens.b64) + sum(len(t.b64) for t in d.loss_fn_inputs.values())
                   for d in data)
    return out


def preparer(state: TinkerState, model: TinkerModel, tenant: str) -> Callable[[ForwardOp], PreparedOp | Exception]:
    """On the event loop: a function, run in a thread, that checks one of this model's forward ops and
    decodes its tensors for the service, or gives back the error (raised when the op's turn comes)."""
    service = state.service
    try:
        run = service.get_run(model.run_id, tenant)
        host = service.hosts[run.base_model]
    except Exception as exc:  # noqa: BLE001 - the op's future carries it
        error = exc
        return lambda op: error

    def prepare(op: ForwardOp) -> PreparedOp | Exception:
        try:
            return prepare_forward(op, host, run.adapter, service.limits, service.fault_injection)
        except Exception as exc:  # noqa: BLE001
            return exc

    return prepare


def encode_forward_result(result: dict) -> bytes:
    outputs = [{k: WireTensor.model_validate(v).to_array() for k, v in o.items()}
               for o in result.get("loss_fn_outputs", [])]
    return results.encode_forward_backward_output(outputs, tinker_metrics(result.get("metrics", {})))


async def forward_result(result: dict) -> bytes:
    return await asyncio.to_thread(encode_forward_result, result)


async def forward_backward(state: TinkerState, request: Request, tenant: str):
    raw = await read_body(request, state.body_limit)  # its Content-Type was checked: application/x-protobuf
    budget = state.element_budget()
    try:
        decoded = await asyncio.to_thread(decode_forward, raw, budget)
    except proto.ProtoError as exc:
        raise WorkerError(400, "invalid_protobuf", str(exc), exc.field) from None
    model = state.model(decoded.model_id, tenant)
    error = decoded.error
    if error is None:
        prepare = preparer(state, model, tenant)
        work = await asyncio.to_thread(prepare, decoded.op)  # checked and decoded for the service, off the loop
        decoded.op = None
        # one the service refuses still waits its turn as before, holding its body, and fails then
        size = work.nbytes if isinstance(work, PreparedOp) else decoded.size
        # While it waits for an earlier seq_id, a request keeps its body (smaller than the prepared op)
        # and is decoded again, in a thread, when its turn comes.
        reload = (len(raw), lambda: _op_again(raw, state.element_budget(), prepare))
        return gated(state, tenant, model, decoded.seq_id, decoded.digest, work, forward_result, size, reload)
    # Refused: the seq_id is used up by a failed future, so the model's later requests are not held
    # back waiting for it, and the request itself is answered with the reason.
    code = "request_too_large" if error.status == 413 else "invalid_protobuf"
    refusal = WorkerError(error.status, code, str(error), error.field)
    gated(state, tenant, model, decoded.seq_id, decoded.digest, lambda: _raise_now(refusal), None, 0)
    raise refusal


def _raise_now(exc: BaseException):
    raise exc


def _op_again(raw: bytes, budget: proto.ElementBudget, prepare: Callable[[ForwardOp], PreparedOp | Exception]):
    decoded = decode_forward(raw, budget)
    if decoded.error is not None:  # checked once already: only a changed limit could get here
        raise decoded.error
    return prepare(decoded.op)


# --- optim_step ---------------------------------------------------------------------------------------


def _adam_params(body: dict) -> OptimStepOp:
    params = body.get("adam_params") or body.get("optim_params")
    other = body.get("optimizer_params")
    if params is None and isinstance(other, dict) and other.get("type") not in (None, "adam", "adamw"):
        raise bad_request("optimizer_params.type", f"{other.get('type')!r} is not supported; this worker "
                                                   "trains with adamw only")
    params = params or other or {}
    if not isinstance(params, dict):
        raise bad_request("adam_params", "must be an object")
    known = AdamParams.model_fields
    return OptimStepOp(adam_params=AdamParams(**{k: v for k, v in params.items() if k in known}))


def _optim_metrics(result: dict) -> dict:
    m = result.get("metrics", {})
    metrics = {"grad_norm:mean": m.get("grad_norm"), "learning_rate:mean": m.get("learning_rate"),
               "step:max": m.get("step")}
    return {"metrics": {k: float(v) for k, v in metrics.items() if v is not None}}


async def optim_step(state: TinkerState, request: Request, tenant: str):
    body, size, body_digest = await read_json_sized(request, state.body_limit)
    model = state.model(field(body, "model_id", str), tenant)
    return gated(state, tenant, model, body.get("seq_id"), body_digest, lambda: _adam_params(body), _optim_metrics,
                 size)
