"""Writing the protobuf results of the Tinker protocol: ``ForwardBackwardOutput`` and ``SampleResponse``
(messages from ``proto/tinker_wire.proto``, serialized by the protobuf runtime; the packing of numpy
arrays into the protocol's byte fields is ours)."""

from __future__ import annotations

import numpy as np

from server_mock.api.tinker.proto import tinker_wire_pb2 as pb

DTYPE_FLOAT32 = pb.DTYPE_FLOAT32
DTYPE_INT64 = pb.DTYPE_INT64
STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
MASK_LOGPROB = -99999.0  # an empty top-k cell (token id 0)


def _batched_tensor(target: pb.BatchedTensor, arrays: list[np.ndarray]) -> None:
    """One field of an ArrayRecord: every datum's flat array concatenated, with int64 byte offsets, and the
    shape each datum has after its first axis (``trailing_shape``: [] for [N] arrays, [K] for [N, K] ones)."""
    is_float = not arrays or np.issubdtype(arrays[0].dtype, np.floating)
    np_dtype, enum = ("<f4", DTYPE_FLOAT32) if is_float else ("<i8", DTYPE_INT64)
    flat = [np.ascontiguousarray(a, dtype=np_dtype).reshape(-1) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype="<i8")
    np.cumsum([a.nbytes for a in flat], out=offsets[1:])
    target.data = np.concatenate(flat).tobytes() if flat else b""
    target.offsets = offsets.tobytes()
    target.dtype = enum
    if arrays and arrays[0].ndim > 1:
        target.trailing_shape.extend(int(d) for d in arrays[0].shape[1:])


def _trailing_shapes(output: dict[str, np.ndarray]) -> tuple:
    return tuple((name, array.shape[1:]) for name, array in output.items())


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float],
                                   output_type: str = "ArrayRecord") -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord per run of consecutive datums whose arrays have the same shape
    after their first axis (one record when every output is 1-D; soft targets give [N, K] logprobs, and the
    client reads the records in order, each with its own trailing shape)."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type=output_type)
    start = 0
    while start < len(outputs):
        end = start + 1
        while end < len(outputs) and _trailing_shapes(outputs[end]) == _trailing_shapes(outputs[start]):
            end += 1
        record = message.loss_fn_outputs.add(type_tag=output_type, num_datums=end - start)
        for name in outputs[start]:
            _batched_tensor(record.fields[name], [o[name] for o in outputs[start:end]])
        start = end
    if not outputs:
        message.loss_fn_outputs.add(type_tag=output_type, num_datums=0)
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    return message.SerializeToString()


def _topk(target: pb.TopkLogprobs, rows: list[list[tuple[int, float]] | None], k: int) -> None:
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = tok, lp
    target.token_ids, target.logprobs, target.k, target.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def encode_sample_response(sequences: list[dict], prompt_logprobs: list[float | None] | None = None,
                           topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None,
                           topk_k: int = 0) -> bytes:
    """A SampleResponse. ``sequences``: dicts with stop_reason ("stop"/"length"), tokens, logprobs."""
    message = pb.SampleResponse()
    for seq in sequences:
        out = message.sequences.add(stop_reason=STOP_REASON[seq["stop_reason"]],
                                    tokens=np.asarray(seq["tokens"], dtype="<i4").tobytes())
        if seq.get("logprobs") is not None:
            out.logprobs = np.asarray(seq["logprobs"], dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.array([np.nan if v is None else v for v in prompt_logprobs],
                                           dtype="<f4").tobytes()
    if topk_prompt_logprobs is not None and topk_k > 0:
        _topk(message.topk_prompt_logprobs, topk_prompt_logprobs, topk_k)
    return message.SerializeToString()
