"""Training runs and their ops. A forward op's tensors are decoded from their wire form (base64) here, once, in a
worker thread; its result's arrays are encoded back on the model's thread."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
from starlette.requests import Request
from starlette.routing import Route

from pytrio_compat.wire import (
    MAX_LIST_LIMIT,
    Accepted,
    CreateTrainingRun,
    ForwardOp,
    ModelOperationCapabilities,
    TrainingOp,
    TrainingRunInfo,
    TrainingRunList,
    WireDatum,
    WireTensor,
)
from server_mock.api.native.endpoint import endpoint, service_of
from server_mock.errors import bad_request
from server_mock.service.ops import ForwardBatch
from server_mock.service.runs import TrainingRun, register_front
from server_mock.service.worker import WorkerService
from server_mock.training import losses


def run_info(service: WorkerService, run: TrainingRun) -> TrainingRunInfo:
    host = service.models.loaded(run.base_model)
    return TrainingRunInfo(
        training_run_id=run.run_id, base_model=run.base_model, lora=run.spec, vocab_size=host.vocab_size,
        limits=ModelOperationCapabilities(max_tokens_per_request=service.limits.max_tokens_per_request,
                                          max_seq_len=host.max_seq_len),
        last_seq_id=run.last_seq,
    )


def wire_array(tensor: WireTensor, field_name: str) -> np.ndarray:
    try:
        return tensor.to_array()
    except ValueError as exc:
        raise bad_request(field_name, str(exc)) from None


class WireRow(Mapping):
    """One datum's arrays, decoded from base64 when the service reads them (an input the loss does not use is
    never decoded); a bad tensor is a 400 naming its field."""

    def __init__(self, datum: WireDatum, where: str) -> None:
        self._datum, self._where = datum, where

    def __getitem__(self, key: str) -> np.ndarray:
        if key == "tokens":
            return wire_array(self._datum.tokens, f"{self._where}.tokens")
        return wire_array(self._datum.loss_fn_inputs[key], f"{self._where}.loss_fn_inputs.{key}")

    def __contains__(self, key: object) -> bool:
        if key in losses.RECORDED_INPUTS:  # only the worker's sampling records fill these (Tinker provenance)
            return False
        return key == "tokens" or key in self._datum.loss_fn_inputs

    def __iter__(self) -> Iterator[str]:
        yield "tokens"
        yield from self._datum.loss_fn_inputs

    def __len__(self) -> int:
        return 1 + len(self._datum.loss_fn_inputs)


def forward_batch(op: ForwardOp) -> ForwardBatch:
    images = [d.images for d in op.data] if any(d.images for d in op.data) else None
    return ForwardBatch(loss_fn=op.loss_fn, data=[WireRow(d, f"data[{i}]") for i, d in enumerate(op.data)],
                        backward=op.op == "forward_backward", loss_fn_config=op.loss_fn_config, images=images)


def encode_forward_result(result: dict) -> dict:
    """A forward result's arrays as wire tensors (on the model's thread, once)."""
    return {"loss_fn_outputs": [{k: WireTensor.from_array(v).model_dump() for k, v in o.items()}
                                for o in result["loss_fn_outputs"]],
            "metrics": result["metrics"]}


FORWARD = {"protocol": "native", "answer": "forward"}  # journaled with a forward op: its result is encoded
ENCODE = {"forward": encode_forward_result}  # by answer kind, bound once: a renamed function changes nothing


def encoder_for(front: dict):
    return ENCODE.get(front.get("answer", ""))


register_front("native", encoder_for)


async def create_run(request: Request, tenant: str, body: CreateTrainingRun):
    service = service_of(request)

    async def create() -> TrainingRunInfo:
        return run_info(service, await service.runs.create(body, tenant))

    return await request.app.state.idempotency.remember(request, tenant, create)


def _page_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise bad_request(name, f"must be an integer in [{low}, {high}], got {text[:40]!r}") from None
    if not low <= value <= high:
        raise bad_request(name, f"must be an integer in [{low}, {high}], got {value}")
    return value


async def list_runs(request: Request, tenant: str):
    """The caller's live training runs, oldest first: ``limit`` (1-1000, default 20) from ``offset``."""
    service = service_of(request)
    limit = _page_param(request, "limit", 20, 1, MAX_LIST_LIMIT)
    offset = _page_param(request, "offset", 0, 0, 2**31 - 1)
    runs = service.runs.owned(tenant)
    return TrainingRunList(training_runs=[run_info(service, run) for run in runs[offset:offset + limit]],
                           total_count=len(runs))


async def get_run(request: Request, tenant: str):
    service = service_of(request)
    return run_info(service, service.runs.get(request.path_params["run_id"], tenant))


async def delete_run(request: Request, tenant: str):
    await service_of(request).runs.delete(request.path_params["run_id"], tenant)
    return {"deleted": True}


async def submit_op(request: Request, tenant: str, body: TrainingOp, fingerprint: str):
    """An op of a run; ``fingerprint`` (its body's bytes) tells a resent op from a conflicting one."""
    service = service_of(request)
    payload = body.payload
    forward = isinstance(payload, ForwardOp)

    def prepare(run: TrainingRun):  # in a worker thread: a forward op's decoding and checks
        if not forward:
            return fingerprint, payload
        try:
            return fingerprint, service.runs.prepare(run, forward_batch(payload))
        except Exception as exc:  # noqa: BLE001 - raised after the seq_id checks, as if prepared then
            return fingerprint, exc

    admission = await service.runs.submit_off_loop(request.path_params["run_id"], tenant, body.seq_id, prepare,
                                                   front=FORWARD if forward else None)
    return Accepted(request_id=admission.request_id, duplicate=admission.duplicate)


ROUTES = [
    Route("/v1/training_runs", endpoint(create_run, CreateTrainingRun), methods=["POST"]),
    Route("/v1/training_runs", endpoint(list_runs), methods=["GET"]),
    Route("/v1/training_runs/{run_id}", endpoint(get_run), methods=["GET"]),
    Route("/v1/training_runs/{run_id}", endpoint(delete_run), methods=["DELETE"]),
    Route("/v1/training_runs/{run_id}/ops", endpoint(submit_op, TrainingOp, tensors=True, fingerprinted=True),
          methods=["POST"]),
]
