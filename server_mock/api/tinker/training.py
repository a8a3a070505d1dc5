"""Tinker routes that train a model: ``forward_backward`` (a protobuf body) and ``optim_step``, handed to the
service in seq_id order by ``submit.gated``.

A forward_backward body is parsed, checked and turned into the service's op (numpy arrays, straight from the
protobuf's bytes) in a worker thread, so the event loop never decodes or copies tensors. A request that has to
wait for an earlier seq_id keeps only its body, the smaller form, and is decoded again in a thread when its
turn comes. Results are encoded to protobuf on the model's thread (``answers.encode_forward``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from pytrio_compat.wire import OptimStepOp
from server_mock.api import bodies
from server_mock.api.tinker import provenance, schemas
from server_mock.api.tinker.answers import Answer
from server_mock.api.tinker.endpoint import digest, read_body
from server_mock.api.tinker.proto import decode as proto
from server_mock.api.tinker.proto.bounds import TooManyFields, count_fields
from server_mock.api.tinker.state import TinkerModel, TinkerState
from server_mock.api.tinker.submit import gated, read_op
from server_mock.errors import WorkerError, bad_request, raising
from server_mock.service.ops import DATUM_OVERHEAD_BYTES, ForwardBatch, PreparedOp

# --- forward_backward ---------------------------------------------------------------------------------

PROTO_FIELDS_PER_TOKEN = 1  # a datum has about 22 fields (chunks, tensors, shapes) and, in RL, hundreds of tokens
MIN_PROTO_FIELDS = 1 << 16


@dataclass
class DecodedForward:
    model_id: str
    seq_id: int
    digest: str
    op: ForwardBatch | None = None
    error: proto.ProtoError | None = None
    size: int = 0  # of the op's arrays
    spans: list[provenance.DatumSpans] | None = None  # each datum's provenance (model input, loss rows)


def decode_forward(raw: bytes, budget: proto.ElementBudget) -> DecodedForward:
    """Runs in a thread: the checked op of a ForwardBackwardRequest body, or why it is refused.

    A body that is not a ForwardBackwardRequest at all raises; one that is, but carries bad data,
    comes back with ``error`` set, so its seq_id can still be used up in order. Before it is parsed, the body's
    fields are counted (at most ``PROTO_FIELDS_PER_TOKEN`` per token of the request's token budget): parsing holds
    ~50 bytes per message however small, and each datum must hold a token anyway."""
    limit = max(MIN_PROTO_FIELDS, PROTO_FIELDS_PER_TOKEN * (budget.max_tokens or 0))
    try:
        count_fields(raw, proto.pb.ForwardBackwardRequest.DESCRIPTOR, limit)
    except TooManyFields as exc:
        raise proto.ProtoError("body", f"{exc} ({PROTO_FIELDS_PER_TOKEN} per token of limit max_tokens_per_request="
                                       f"{budget.max_tokens})", status=413) from None
    message = proto.parse_forward_backward_request(raw)
    out = DecodedForward(message.model_id, message.seq_id, digest(raw))
    try:
        req = proto.decode_forward_backward_request(message, budget)
    except proto.ProtoError as exc:
        out.error = exc
        return out
    data = [{**d.loss_fn_inputs, "tokens": d.tokens} for d in req.data]  # a loss input named "tokens" is not one
    images = [d.images for d in req.data] if any(d.images for d in req.data) else None
    out.op = ForwardBatch(loss_fn=req.loss_fn, data=data, backward=not req.forward_only,
                          loss_fn_config=req.loss_fn_config, images=images)
    out.spans = [(d.model_input_spans, d.loss_fn_input_spans) for d in req.data]
    out.size = sum(DATUM_OVERHEAD_BYTES + sum(array.nbytes for array in row.values()) for row in data)
    return out


def preparer(state: TinkerState, model: TinkerModel, tenant: str) -> Callable[..., PreparedOp | Exception]:
    """On the event loop: a function, run in a thread, that checks one of this model's forward ops (and its
    datums' provenance spans) for the service, or gives back the error (raised when the op's turn comes)."""
    runs = state.service.runs
    try:
        run = runs.get(model.run_id, tenant)
    except Exception as exc:  # noqa: BLE001 - the op's future carries it
        error = exc
        return lambda op, spans=None: error

    def prepare(op: ForwardBatch, spans: list[provenance.DatumSpans] | None = None) -> PreparedOp | Exception:
        try:
            op = provenance.with_recorded_inputs(state.service.stability, tenant, model.session_id, op,
                                                 spans or [(None, None)] * len(op.data))
            return runs.prepare(run, op)
        except Exception as exc:  # noqa: BLE001
            return exc

    return prepare


async def forward_backward(state: TinkerState, request: Request, tenant: str):
    raw = await read_body(request, state.tensor_limit, json_values=False)  # Content-Type: application/x-protobuf
    budget = state.element_budget()
    try:
        async with bodies.parsing(request, len(raw)):
            decoded = await asyncio.to_thread(decode_forward, raw, budget)
    except proto.ProtoError as exc:
        code = "request_too_large" if exc.status == 413 else "invalid_protobuf"
        raise WorkerError(exc.status, code, str(exc), exc.field) from None
    model = state.model(decoded.model_id, tenant)
    error = decoded.error
    if error is None:
        prepare = preparer(state, model, tenant)
        work = await asyncio.to_thread(prepare, decoded.op, decoded.spans)  # checked for the service, off the loop
        decoded.op = decoded.spans = None
        # one the service refuses still waits its turn as before, holding its body, and fails then
        size = work.nbytes if isinstance(work, PreparedOp) else decoded.size
        # While it waits for an earlier seq_id, a request keeps its body (smaller than the prepared op)
        # and is decoded again, in a thread, when its turn comes.
        reload = (len(raw), lambda: _op_again(raw, state.element_budget(), prepare))
        return gated(state, tenant, model, decoded.seq_id, decoded.digest, work, Answer("forward"), size, reload)
    # Refused: the seq_id is used up by a failed future, so the model's later requests are not held
    # back waiting for it, and the request itself is answered with the reason.
    code = "request_too_large" if error.status == 413 else "invalid_protobuf"
    refusal = WorkerError(error.status, code, str(error), error.field)
    gated(state, tenant, model, decoded.seq_id, decoded.digest, raising(refusal), None, 0)
    raise refusal


def _op_again(raw: bytes, budget: proto.ElementBudget, prepare: Callable[[ForwardBatch], PreparedOp | Exception]):
    decoded = decode_forward(raw, budget)
    if decoded.error is not None:  # checked once already: only a changed limit could get here
        raise decoded.error
    return prepare(decoded.op, decoded.spans)


# --- optim_step ---------------------------------------------------------------------------------------


def _sent(params: schemas.Adam | None) -> schemas.Adam | None:
    return params if params is not None and params.model_fields_set else None  # {} asks for nothing


def _adam_params(body: schemas.OptimStep) -> OptimStepOp:
    params = _sent(body.adam_params) or _sent(body.optim_params)
    other = body.optimizer_params
    if params is None and other is not None and other.type not in (None, "adam", "adamw"):
        raise bad_request("optimizer_params.type", f"{other.type[:60]!r} is not supported; this worker "
                                                   "trains with adamw only")
    params = params or other or schemas.Adam()
    return OptimStepOp(adam_params=params.params())


async def optim_step(state: TinkerState, request: Request, tenant: str):
    body, size = await read_op(state, request, tenant, schemas.OptimStep)
    model = state.model(body.model_id, tenant)
    return gated(state, tenant, model, body.seq_id, body.digest(), lambda: _adam_params(body), Answer("optim"),
                 size)
