"""Provenance on the Tinker path: what ``asample`` records for ``record_stability_info`` sampling clients, and
how a forward_backward datum's spans become the ``stable_reinforce`` loss's recorded inputs.

A sampling client records only when the worker knows its session (``create_sampling_client``,
``save_weights_and_get_sampling_client``): provenance works within one session, so a record is scoped to the
session that sampled it, and a training request may name only sequences of its own model's session. The
records themselves are the service's (service/stability.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server_mock.errors import bad_request
from server_mock.service.ops import ForwardBatch
from server_mock.service.stability import Span, StabilityRecords
from server_mock.training import losses

DatumSpans = tuple[list[Span] | None, list[Span] | None]  # (model_input_spans, loss_fn_input_spans)

NO_SESSION = ("record_stability_info needs a sampling client of a session (ServiceClient.create_sampling_client, "
              "TrainingClient.create_sampling_client or save_weights_and_get_sampling_client); this request "
              "names no sampling session")


def record_samples(records: StabilityRecords, tenant: str, scope: str, sampler_id: str, prompt: Sequence[int],
                   sequence_ids: Sequence[str], sequences: Sequence[dict]) -> None:
    """Keep what ``asample`` returned for each sequence id (in a thread, before the result is encoded)."""
    records.record(tenant, scope, sampler_id, prompt,
                   [(sid, seq["tokens"], seq["logprobs"]) for sid, seq in zip(sequence_ids, sequences)])


def with_recorded_inputs(records: StabilityRecords, tenant: str, scope: str, op: ForwardBatch,
                         spans: Sequence[DatumSpans]) -> ForwardBatch:
    """The op with the loss inputs only the worker may fill in: for ``stable_reinforce`` each datum's
    ``recorded_logprobs`` / ``recorded_mask`` from the records its spans name (a 400 naming the datum and field
    when they do not check out); for every other loss the spans are ignored. Inputs of those names that the
    client sent are never used. Runs in a worker thread."""
    data = [{k: v for k, v in datum.items() if k not in losses.RECORDED_INPUTS} for datum in op.data]
    if op.loss_fn == "stable_reinforce":
        for i, (datum, (model_spans, loss_spans)) in enumerate(zip(data, spans)):
            where = f"data[{i}]"
            n = len(datum["tokens"])
            targets = _vector(datum, "target_tokens", n, where)
            advantages = _vector(datum, "advantages", n, where)
            datum["recorded_logprobs"], datum["recorded_mask"] = records.resolve(
                tenant, scope, where, datum["tokens"], targets, advantages, model_spans, loss_spans)
    return ForwardBatch(loss_fn=op.loss_fn, data=data, backward=op.backward, loss_fn_config=op.loss_fn_config)


def _vector(datum: dict, key: str, n: int, where: str) -> np.ndarray:
    value = datum.get(key)
    field = f"{where}.loss_fn_inputs.{key}"
    if value is None:
        raise bad_request(field, "required by loss 'stable_reinforce' (needs target_tokens, logprobs, advantages)")
    if value.shape != (n,):
        raise bad_request(field, f"must have shape [{n}] (the length of the tokens), got {list(value.shape)}")
    return value
