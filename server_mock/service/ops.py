"""A training op made ready to queue: checked in full and its tensors decoded, before it is accepted.

Decoding is proportional to the body (base64 tensors of up to ``--max-body-bytes``), so for forward
ops it runs in a worker thread, never on the event loop (``RunsMixin.submit_op_off_loop`` and the
Tinker ``forward_backward`` route). What it reads is immutable once a run exists: the model's
vocabulary size and context length, the worker's limits, the run's adapter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from pytrio_compat.wire import ForwardOp, WireTensor
from server_mock.config import Limits
from server_mock.engine.host import ModelHost
from server_mock.errors import bad_request
from server_mock.lora import Adapter
from server_mock.service.validation import validate_data
from server_mock.training import faults, losses

DATUM_OVERHEAD_BYTES = 256  # counted per datum on top of its arrays


@dataclass
class PreparedOp:
    """An op ready for the model's thread: ``work()`` computes its result; ``nbytes`` is what it holds."""

    kind: str
    work: Callable[[], dict]
    nbytes: int = 0


def op_digest(payload: BaseModel) -> str:
    """The hash of an op's payload that tells a resent op (same hash) from a conflicting one."""
    return hashlib.sha256(payload.model_dump_json().encode()).hexdigest()


def prepare_forward(payload: ForwardOp, host: ModelHost, adapter: Adapter, limits: Limits,
                    fault_injection: bool) -> PreparedOp:
    """Check a forward/forward_backward op and decode its tensors (raises a 4xx WorkerError naming the
    field). Safe to run in a worker thread."""
    loss_fn = payload.loss_fn
    backward = payload.op == "forward_backward"
    loss_config, fault = faults.split_config(payload.loss_fn_config, fault_injection, backward)
    try:
        config = losses.resolve_loss_config(loss_fn, loss_config)
    except losses.LossConfigError as exc:
        raise bad_request(exc.field, str(exc), code="invalid_loss") from None
    data = validate_data(payload, host, limits)

    def run_forward() -> dict:
        with faults.injected(fault, list(adapter.params.values())):
            out = host.forward_backward(adapter, data, loss_fn, config, backward)
        return {
            "loss_fn_outputs": [{k: WireTensor.from_array(v).model_dump() for k, v in o.items()}
                                for o in out["outputs"]],
            "metrics": out["metrics"],
        }

    nbytes = sum(DATUM_OVERHEAD_BYTES + sum(array.nbytes for array in row.values()) for row in data)
    return PreparedOp(payload.op, run_forward, nbytes)


def hash_and_prepare(payload: ForwardOp, host: ModelHost, adapter: Adapter, limits: Limits,
                     fault_injection: bool) -> tuple[str, PreparedOp | Exception]:
    """In a worker thread: the payload's digest, and the prepared op or the error preparing it gave
    (raised later, after the seq_id checks, as it would have been had the op been prepared then)."""
    digest = op_digest(payload)
    try:
        return digest, prepare_forward(payload, host, adapter, limits, fault_injection)
    except Exception as exc:  # noqa: BLE001 - handed back to be raised in order
        return digest, exc
