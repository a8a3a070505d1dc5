"""Training ops in the engine's form, and how one is made ready to queue: checked in full before it is accepted.

A forward op carries its datums as numpy arrays (``ForwardBatch``): each front end decodes its own wire form
once, at its edge, and the engine's results come back as arrays for the front end to encode. Checking a
forward op reads every array of the request, so front ends run ``prepare_forward`` in a worker thread, never on
the event loop. What it reads is immutable once a run exists: the model's vocabulary size and context length,
the worker's limits, the run's adapter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytrio_compat.wire import WireImage
from server_mock.config import Limits
from server_mock.engine.host import ModelHost
from server_mock.errors import bad_request
from server_mock.service.validation import validate_rows
from server_mock.storage import crash_points
from server_mock.training import faults, losses

DATUM_OVERHEAD_BYTES = 256  # counted per datum on top of its arrays


@dataclass(frozen=True)
class ForwardBatch:
    """A ``forward`` (no gradient) or ``forward_backward`` call: its loss and its datums, each a mapping of
    ``tokens`` and the loss inputs by name to numpy arrays (see ``validation.validate_rows``). ``loss_scale``
    multiplies the summed loss whose gradient accumulates (1 for the native and Tinker protocols, whose losses are
    sums; the PyTRIO protocol's per-call mean passes 1/denominator); metrics are never scaled."""

    loss_fn: str
    data: Sequence[Mapping[str, np.ndarray]]
    backward: bool
    loss_fn_config: dict[str, Any] = field(default_factory=dict)
    loss_scale: float = 1.0
    images: Sequence[Sequence[WireImage] | None] | None = None  # datum i's image chunks (None: text only)

    @property
    def kind(self) -> str:
        return "forward_backward" if self.backward else "forward"


@dataclass
class PreparedOp:
    """An op ready for the model's thread: ``work()`` computes its result; ``nbytes`` is what it holds; ``record``
    is what the durable journal keeps to run it again after a restart (service/restore.py); ``tokens`` are its
    datums' tokens (what it costs of its key's token budget)."""

    kind: str
    work: Callable[[], dict]
    nbytes: int = 0
    record: dict | None = None
    tokens: int = 0
    # the same work in parts, paused between micro-batches (engine/jobs.py ``Job.open_steps``); None: in one go
    steps: Callable[[], Generator[int, None, dict]] | None = None


def prepare_forward(batch: ForwardBatch, host: ModelHost, adapter, limits: Limits,
                    fault_injection: bool) -> PreparedOp:
    """Check a forward/forward_backward op (raises a 4xx WorkerError naming the field). Its result:
    ``loss_fn_outputs`` (one dict of numpy arrays per datum) and ``metrics``. Safe to run in a worker thread."""
    loss_fn = batch.loss_fn
    if not math.isfinite(batch.loss_scale) or batch.loss_scale < 0:
        raise bad_request("loss_scale", f"must be a finite number >= 0, got {batch.loss_scale}")
    loss_config, fault = faults.split_config(batch.loss_fn_config, fault_injection, batch.backward)
    try:
        config = losses.resolve_loss_config(loss_fn, loss_config)
    except losses.LossConfigError as exc:
        raise bad_request(exc.field, str(exc), code="invalid_loss") from None
    data = validate_rows(loss_fn, batch.data, host, limits, batch.images)

    def run_forward() -> dict:
        with faults.injected(fault, list(adapter.params.values())):
            out = host.forward_backward(adapter, data, loss_fn, config, batch.backward, batch.loss_scale)
        if batch.backward:
            crash_points.reached("forward_backward")  # (kill tests) the gradients accumulated, nothing answered
        return {"loss_fn_outputs": out["outputs"], "metrics": out["metrics"]}

    open_steps = getattr(host, "forward_backward_steps", None)  # a host that cannot pause runs it in one go

    def run_in_steps() -> Generator[int, None, dict]:
        out = yield from open_steps(adapter, data, loss_fn, config, batch.backward, batch.loss_scale)
        if batch.backward:
            crash_points.reached("forward_backward")
        return {"loss_fn_outputs": out["outputs"], "metrics": out["metrics"]}

    steps = run_in_steps if open_steps is not None and fault is None else None
    nbytes = sum(DATUM_OVERHEAD_BYTES + sum(_held_bytes(value) for value in row.values()) for row in data)
    tokens = sum(len(row["tokens"]) for row in data)
    return PreparedOp(batch.kind, run_forward, nbytes, _record(batch, loss_fn, data), tokens, steps)


def _record(batch: ForwardBatch, loss_fn: str, data: list) -> dict:
    """What the journal keeps to run the op again: the checked rows of a text batch; for a batch with images, the
    rows as the client sent them with its image chunks (checking expands them again, the same way)."""
    record = {"op": "forward", "loss_fn": loss_fn, "backward": batch.backward,
              "loss_fn_config": dict(batch.loss_fn_config), "loss_scale": batch.loss_scale}
    if batch.images is None or not any(batch.images):
        return {**record, "data": data}
    rows = [{name: np.asarray(row[name]) for name in row} for row in batch.data]
    images = [None if chunks is None else [chunk.model_dump(mode="json") for chunk in chunks]
              for chunks in batch.images]
    return {**record, "data": rows, "images": images}


def _held_bytes(value) -> int:
    """An array's bytes, or a datum's image spans' (their pixel inputs)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    return sum(span.image.tokens.nbytes + sum(a.nbytes for a in span.image.pixel_inputs.values()) for span in value)
