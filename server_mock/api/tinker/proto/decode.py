"""The protobuf side of the Tinker protocol: reading the ``ForwardBackwardRequest`` body
(the ``ForwardBackwardOutput`` / ``SampleResponse`` results are written by encode.py).

The messages are declared in ``proto/tinker_wire.proto`` (field numbers as the protocol defines them)
and parsed and written by the ``protobuf`` runtime. What stays here by hand is what the schema cannot
say: the worker's checks on a decoded request (sizes, dtypes, sparse indices), and the unpacking of
the protocol's byte fields into numpy arrays.

Every size a client declares is checked before anything is allocated: a tensor's ``shape`` is
multiplied out in Python integers and compared with ``ElementBudget`` first, so a 100-byte body that
declares a ``[1, 2e10]`` sparse tensor is refused without touching memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from server_mock.api.tinker.proto import tinker_wire_pb2 as pb
from pytrio_compat.wire import ImageChunk
from pytrio_compat.wire import WireImage
from server_mock.service.stability import Span

DTYPE_FLOAT32 = pb.DTYPE_FLOAT32
DTYPE_INT64 = pb.DTYPE_INT64
DTYPE_INT32 = pb.DTYPE_INT32
DTYPE_BFLOAT16 = pb.DTYPE_BFLOAT16

_NP_DTYPES = {DTYPE_FLOAT32: "<f4", DTYPE_INT64: "<i8", DTYPE_INT32: "<i4", DTYPE_BFLOAT16: "<u2"}


class ProtoError(ValueError):
    """The body is not an acceptable message. ``field`` names the part at fault; ``status`` is 400,
    or 413 when a declared size is over a limit."""

    def __init__(self, field_name: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status = status


class ElementBudget:
    """How many tensor elements one request may still declare (all its loss_fn_inputs together), and
    how many tokens its datums may hold."""

    def __init__(self, limit: int, reason: str, max_tokens: int | None = None, max_datums: int | None = None) -> None:
        self.limit = limit
        self.max_datums = max_datums
        self.left = limit
        self.reason = reason
        self.max_tokens = max_tokens
        self.tokens = 0

    def take_tokens(self, count: int, where: str) -> None:
        self.tokens += count
        if self.max_tokens is not None and self.tokens > self.max_tokens:
            raise ProtoError(where, f"the request's datums hold more than {self.max_tokens} tokens "
                                    f"(limit max_tokens_per_request={self.max_tokens})", status=413)

    def take(self, count: int, where: str) -> None:
        if count > self.left:
            raise ProtoError(where, f"declares {count} elements, over the {self.left} this request has left "
                                    f"(at most {self.limit}: {self.reason})", status=413)
        self.left -= count


# --- decoding --------------------------------------------------------------------------------------


def _array_from_bytes(raw: bytes, dtype: int, where: str) -> np.ndarray:
    """A flat array of ``raw`` in wire ``dtype``: float32 or int64, native order, a writable copy."""
    np_dtype = _NP_DTYPES.get(dtype)
    if np_dtype is None:
        raise ProtoError(where, f"unsupported dtype enum {dtype} (expected FLOAT32=1, INT64=2, INT32=3 or "
                                "BFLOAT16=4)")
    itemsize = np.dtype(np_dtype).itemsize
    if len(raw) % itemsize:
        raise ProtoError(where, f"{len(raw)} bytes is not a whole number of {itemsize}-byte values")
    arr = np.frombuffer(raw, dtype=np_dtype)
    if dtype == DTYPE_BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32 if dtype == DTYPE_FLOAT32 else np.int64)


MAX_TENSOR_RANK = 4  # loss inputs are 1-D (2-D for per-token weights); a little room beyond
MAX_TENSOR_DIM = 2**31 - 1  # any one axis; the element budget bounds the product


def _declared_count(shape: list[int], where: str) -> int:
    if len(shape) > MAX_TENSOR_RANK:
        raise ProtoError(f"{where}.shape", f"{shape} has {len(shape)} dimensions; at most {MAX_TENSOR_RANK}")
    if any(d < 0 for d in shape):
        raise ProtoError(f"{where}.shape", f"{shape} has a negative dimension")
    return math.prod(shape)


def _check_axes(shape: list[int], where: str) -> None:
    """After the element budget: an empty shape may still name an axis no array can take
    (numpy will not shape zero elements as ``[0, 2**62, 2**62]``)."""
    if any(d > MAX_TENSOR_DIM for d in shape):
        raise ProtoError(f"{where}.shape", f"{shape} has a dimension over {MAX_TENSOR_DIM}", status=413)


def _csr_to_dense(csr: pb.SparseCsr, dtype: int, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise ProtoError(f"{where}.shape", f"a sparse CSR tensor must be 2-D, got shape {shape}")
    rows, cols = shape
    values = _array_from_bytes(csr.values, dtype, f"{where}.sparse_csr.values")
    crow = _array_from_bytes(csr.crow_indices, DTYPE_INT64, f"{where}.sparse_csr.crow_indices")
    col = _array_from_bytes(csr.col_indices, DTYPE_INT64, f"{where}.sparse_csr.col_indices")
    if len(col) != len(values):
        raise ProtoError(f"{where}.sparse_csr.col_indices", f"{len(col)} column indices for {len(values)} values")
    if len(crow) != rows + 1:
        raise ProtoError(f"{where}.sparse_csr.crow_indices", f"needs rows + 1 = {rows + 1} entries, got {len(crow)}")
    if crow[0] != 0 or crow[-1] != len(values) or (np.diff(crow) < 0).any():
        raise ProtoError(f"{where}.sparse_csr.crow_indices", f"must rise from 0 to the number of values "
                                                             f"({len(values)}) without going down")
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise ProtoError(f"{where}.sparse_csr.col_indices", f"column indices must be in [0, {cols})")
    out = np.zeros((rows, cols), dtype=values.dtype)
    out[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return out


def decode_tensor(tensor: pb.Tensor, where: str, budget: ElementBudget) -> np.ndarray:
    """A ``Tensor`` as a numpy array: float32 or int64, dense (CSR is expanded with zeros)."""
    if tensor.dtype == pb.DTYPE_UNSPECIFIED:
        raise ProtoError(f"{where}.dtype", "the tensor has no dtype")
    shape = list(tensor.shape)
    encoding = tensor.WhichOneof("encoding")
    if encoding == "sparse_csr":
        count = _declared_count(shape, where)
        budget.take(count, f"{where}.shape")
        _check_axes(shape, where)
        return _csr_to_dense(tensor.sparse_csr, tensor.dtype, shape, where)
    np_dtype = _NP_DTYPES.get(tensor.dtype)
    if np_dtype is not None:  # counted before the array is made
        budget.take(len(tensor.dense) // np.dtype(np_dtype).itemsize, where)
    arr = _array_from_bytes(tensor.dense, tensor.dtype, where)
    if shape:
        if _declared_count(shape, where) != arr.size:
            raise ProtoError(f"{where}.shape", f"{shape} does not match the {arr.size} values sent")
        _check_axes(shape, where)
        arr = arr.reshape(shape)
    return arr


@dataclass
class ProtoDatum:
    tokens: np.ndarray  # int64 [N]
    loss_fn_inputs: dict[str, np.ndarray]
    # provenance (Datum.with_provenance): runs tiling model_input and target_tokens, both or neither
    model_input_spans: list[Span] | None = None
    loss_fn_input_spans: list[Span] | None = None
    images: list[WireImage] | None = None  # image chunks, each before text token ``position`` of ``tokens``


MAX_SEQUENCE_ID_CHARS = 256


def _decode_spans(spans, where: str, size: int | None, budget: ElementBudget) -> list[Span]:
    """One provenance list: each run a prompt or sampled span with a sequence id, offset >= 0 and length >= 0
    (the SDK allows empty runs), together tiling the ``size`` positions of their field (None: not checked here,
    the field is missing and the loss's checks say so)."""
    bound = 2 * (size or 0) + 2  # runs that tile ``size`` positions, allowing a few empty ones
    if len(spans) > bound:
        raise ProtoError(where, f"{len(spans)} provenance spans for {size} positions (at most {bound})", status=413)
    budget.take(len(spans), where)
    out = []
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise ProtoError(f"{where}[{j}]", "a provenance span with neither prompt_tokens nor sampled_tokens")
        ref = getattr(span, kind)
        if not ref.sequence_id or len(ref.sequence_id) > MAX_SEQUENCE_ID_CHARS:
            raise ProtoError(f"{where}[{j}].sequence_id", f"must be a non-empty SampledSequence.sequence_id of at "
                                                          f"most {MAX_SEQUENCE_ID_CHARS} characters")
        if ref.offset < 0 or ref.length < 0 or ref.offset > MAX_TENSOR_DIM or ref.length > MAX_TENSOR_DIM:
            raise ProtoError(f"{where}[{j}]", f"offset ({ref.offset}) and length ({ref.length}) must be in "
                                              f"[0, {MAX_TENSOR_DIM}]")
        out.append(Span("prompt" if kind == "prompt_tokens" else "sampled", ref.sequence_id, int(ref.offset),
                        int(ref.length)))
    if size is not None and sum(s.length for s in out) != size:
        raise ProtoError(where, f"the spans must tile the field: their lengths add up to "
                                f"{sum(s.length for s in out)}, the field has {size} positions")
    return out


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    data: list[ProtoDatum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def parse_forward_backward_request(buf: bytes) -> pb.ForwardBackwardRequest:
    """The message itself, unchecked; ProtoError if the bytes are not one."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(buf)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ProtoError("body", f"not a ForwardBackwardRequest protobuf ({exc or type(exc).__name__})") from None
    return message


def _decode_datum(datum: pb.Datum, index: int, budget: ElementBudget) -> ProtoDatum:
    where = f"data[{index}]"
    tokens: list[np.ndarray] = []
    images: list[WireImage] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            budget.take_tokens(len(chunk.encoded_text.tokens) // 4, f"{where}.model_input")
            tokens.append(_array_from_bytes(chunk.encoded_text.tokens, DTYPE_INT32, f"{where}.model_input[{j}]"))
        elif kind == "image":
            images.append(_image(chunk.image, sum(len(t) for t in tokens), f"{where}.model_input[{j}]"))
        elif kind == "dmel":
            raise ProtoError(f"{where}.model_input[{j}]", "audio (dmel) chunks are not supported")
        else:
            raise ProtoError(f"{where}.model_input[{j}]", "an empty chunk (expected encoded_text)")
    # refused now: a body of empty datums would cost decoding for nothing
    if not any(len(t) for t in tokens) and not images:
        raise ProtoError(f"{where}.model_input", "a datum needs at least one token")
    inputs = {key: decode_tensor(value, f"{where}.loss_fn_inputs.{key}", budget)
              for key, value in datum.loss_fn_inputs.items()}
    all_tokens = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    out = ProtoDatum(all_tokens.astype(np.int64, copy=False), inputs, images=images or None)
    if images and (datum.model_input_spans or datum.loss_fn_input_spans):
        raise ProtoError(f"{where}.model_input_spans", "provenance spans are not taken on a datum with image chunks")
    if datum.model_input_spans or datum.loss_fn_input_spans:
        if not (datum.model_input_spans and datum.loss_fn_input_spans):
            raise ProtoError(f"{where}.model_input_spans", "model_input_spans and loss_fn_input_spans are set "
                                                           "together or not at all (Datum.with_provenance)")
        targets = inputs.get("target_tokens")
        out.model_input_spans = _decode_spans(datum.model_input_spans, f"{where}.model_input_spans",
                                              len(all_tokens), budget)
        out.loss_fn_input_spans = _decode_spans(datum.loss_fn_input_spans, f"{where}.loss_fn_input_spans",
                                                None if targets is None or targets.ndim == 0 else len(targets), budget)
    return out


def _image(chunk, position: int, where: str) -> WireImage:
    """An image chunk as the service takes it (its bytes are decoded and bounded there)."""
    if not chunk.data:
        raise ProtoError(f"{where}.image.data", "is empty")
    if chunk.format not in ("png", "jpeg"):
        raise ProtoError(f"{where}.image.format", f"must be png or jpeg, got {chunk.format[:40]!r}")
    expected = chunk.expected_tokens if chunk.HasField("expected_tokens") else None
    if expected is not None and expected < 1:
        raise ProtoError(f"{where}.image.expected_tokens", f"must be >= 1, got {expected}")
    return WireImage(position=position, chunk=ImageChunk(data=chunk.data, format=chunk.format,
                                                         expected_tokens=expected))


def decode_forward_backward_request(buf: bytes | pb.ForwardBackwardRequest,
                                    budget: ElementBudget | None = None) -> ForwardBackwardRequest:
    """A checked request with numpy arrays. ``budget`` bounds the elements its tensors may declare."""
    message = parse_forward_backward_request(buf) if isinstance(buf, bytes) else buf
    budget = budget or ElementBudget(1 << 62, "no limit")
    req = ForwardBackwardRequest(model_id=message.model_id, seq_id=message.seq_id, loss_fn=message.loss_fn,
                                 forward_only=message.forward_only)
    if budget.max_datums is not None and len(message.data) > budget.max_datums:
        raise ProtoError("data", f"{len(message.data)} datums exceeds limit max_datums_per_request={budget.max_datums} "
                                 "(--max-datums-per-request); split the batch into requests of at most that many",
                         status=413)
    req.data = [_decode_datum(datum, i, budget) for i, datum in enumerate(message.data)]
    if message.loss_fn_config_v2:  # v2 carries strings too; numbers are in both maps
        req.loss_fn_config = {key: getattr(value, value.WhichOneof("value") or "number")
                              for key, value in message.loss_fn_config_v2.items()}
    else:
        req.loss_fn_config = dict(message.loss_fn_config)
    return req
