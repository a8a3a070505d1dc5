"""The protobuf messages of the Tinker wire protocol (package ``tinker_public``), hand-written.

Only three messages cross the wire as protobuf: ``ForwardBackwardRequest`` (the one protobuf request),
and the ``ForwardBackwardOutput`` / ``SampleResponse`` results of ``retrieve_future``. They are
declared here by field number, so the worker needs neither the ``tinker`` package nor generated code:

  ForwardBackwardRequest  model_id=1 string, seq_id=2 int32, data=3 Datum*, loss_fn=4 string,
                          loss_fn_config=5 map<string,double>, forward_only=6 bool,
                          loss_fn_config_v2=7 map<string,LossConfigValue{number=1 double | text=2 string}>
  Datum                   model_input=1 Chunk*, loss_fn_inputs=2 map<string,Tensor>, spans=3,4 (ignored)
  Chunk                   encoded_text=1 {tokens=1 bytes int32 LE} | image=2 | dmel=3
  Tensor                  dense=1 bytes | sparse_csr=2 {values=1, crow_indices=2, col_indices=3 (int64)};
                          dtype=3 DType; shape=4 int64*
  ForwardBackwardOutput   loss_fn_output_type=1 string, loss_fn_outputs=2 ArrayRecord*, metrics=3 map<string,double>
  ArrayRecord             type_tag=1 string, fields=2 map<string,BatchedTensor>, num_datums=3 int64
  BatchedTensor           data=1 bytes, offsets=2 bytes (int64 byte offsets, n+1), dtype=3, trailing_shape=4 int64*
  SampleResponse          sequences=1 SampledSequence*, prompt_logprobs=2 bytes (float32, NaN = not scored),
                          topk_prompt_logprobs=3 TopkLogprobs, prompt_cache_hit_tokens=4 int32
  SampledSequence         stop_reason=1 enum (STOP=0, LENGTH=1), tokens=2 bytes int32, logprobs=3 bytes float32
  TopkLogprobs            token_ids=1 bytes int32 (N x K), logprobs=2 bytes float32, k=3 uint32, length=4 uint32
  enum DType              UNSPECIFIED=0, FLOAT32=1, INT64=2, INT32=3, BFLOAT16=4
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
DTYPE_BFLOAT16 = 4
STOP_REASON = {"stop": 0, "length": 1}
MASK_LOGPROB = -99999.0  # an empty top-k cell (token id 0)

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


class ProtoError(ValueError):
    """The body is not a well-formed message of the expected type."""


# --- decoding --------------------------------------------------------------------------------------


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ProtoError("varint too long")


def iter_fields(buf: bytes):
    """Yield ``(field_number, wire_type, value)``: an int for varints, bytes for everything else."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ProtoError("field number 0")
        if wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise ProtoError(f"field {number}: length {length} runs past the end of the message")
            value, pos = buf[pos:pos + length], pos + length
        elif wire == _WIRE_I64:
            if pos + 8 > end:
                raise ProtoError(f"field {number}: truncated fixed64")
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == _WIRE_I32:
            if pos + 4 > end:
                raise ProtoError(f"field {number}: truncated fixed32")
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ProtoError(f"field {number}: unsupported wire type {wire}")
        yield number, wire, value


def _signed(value: int, bits: int) -> int:
    value &= (1 << 64) - 1
    if value >= 1 << 63:
        value -= 1 << 64
    if bits == 32:
        value = ((value + (1 << 31)) % (1 << 32)) - (1 << 31)
    return value


def _string(value, what: str) -> str:
    if not isinstance(value, bytes):
        raise ProtoError(f"{what}: expected a string")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtoError(f"{what}: not valid UTF-8") from None


def _double(wire: int, value) -> float:
    if wire != _WIRE_I64:
        raise ProtoError("expected a double")
    return struct.unpack("<d", value)[0]


def _repeated_int64(wire: int, value) -> list[int]:
    if wire == _WIRE_VARINT:
        return [_signed(value, 64)]
    out, pos = [], 0
    while pos < len(value):
        v, pos = _read_varint(value, pos)
        out.append(_signed(v, 64))
    return out


def _map_entry(buf: bytes) -> tuple[str, int, object]:
    key, vwire, val = "", None, None
    for number, wire, value in iter_fields(buf):
        if number == 1:
            key = _string(value, "map key")
        elif number == 2:
            vwire, val = wire, value
    return key, vwire, val


_NP_DTYPES = {DTYPE_FLOAT32: "<f4", DTYPE_INT64: "<i8", DTYPE_INT32: "<i4", DTYPE_BFLOAT16: "<u2"}


def _array_from_bytes(raw: bytes, dtype: int, what: str) -> np.ndarray:
    np_dtype = _NP_DTYPES.get(dtype)
    if np_dtype is None:
        raise ProtoError(f"{what}: unsupported dtype enum {dtype}")
    itemsize = np.dtype(np_dtype).itemsize
    if len(raw) % itemsize:
        raise ProtoError(f"{what}: {len(raw)} bytes is not a whole number of {itemsize}-byte values")
    arr = np.frombuffer(raw, dtype=np_dtype)
    if dtype == DTYPE_BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype == DTYPE_INT32:
        return arr.astype(np.int64)
    return arr.astype(np.float32 if dtype == DTYPE_FLOAT32 else np.int64)  # native byte order, a writable copy


def decode_tensor(buf: bytes, what: str) -> np.ndarray:
    """A ``Tensor`` as a numpy array: float32 or int64, dense (CSR is expanded with zeros)."""
    dense = csr = None
    dtype = 0
    shape: list[int] = []
    for number, wire, value in iter_fields(buf):
        if number == 1:
            dense = value
        elif number == 2:
            csr = value
        elif number == 3:
            dtype = value
        elif number == 4:
            shape.extend(_repeated_int64(wire, value))
    if dtype == 0:
        raise ProtoError(f"{what}: tensor has no dtype")
    if csr is not None:
        parts: dict[int, bytes] = {}
        for number, _, value in iter_fields(csr):
            parts[number] = value
        values = _array_from_bytes(parts.get(1, b""), dtype, what)
        crow = _array_from_bytes(parts.get(2, b""), DTYPE_INT64, what)
        col = _array_from_bytes(parts.get(3, b""), DTYPE_INT64, what)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise ProtoError(f"{what}: inconsistent sparse CSR tensor (shape {shape})")
        out = np.zeros(shape, dtype=values.dtype)
        for row in range(shape[0]):
            lo, hi = int(crow[row]), int(crow[row + 1])
            if not 0 <= lo <= hi <= len(col) or ((col[lo:hi] < 0) | (col[lo:hi] >= shape[1])).any():
                raise ProtoError(f"{what}: sparse CSR indices out of range")
            out[row, col[lo:hi]] = values[lo:hi]
        return out
    arr = _array_from_bytes(dense or b"", dtype, what)
    if shape:
        if any(d < 0 for d in shape) or math.prod(shape) != arr.size:
            raise ProtoError(f"{what}: shape {shape} does not match {arr.size} values")
        arr = arr.reshape(shape)
    return arr


@dataclass
class ProtoDatum:
    tokens: np.ndarray  # int64 [N]
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    data: list[ProtoDatum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def peek_ids(buf: bytes) -> tuple[str, int]:
    """``(model_id, seq_id)`` of a ForwardBackwardRequest, without decoding the data."""
    model_id, seq_id = "", 0
    for number, wire, value in iter_fields(buf):
        if number == 1 and wire == _WIRE_LEN:
            model_id = _string(value, "model_id")
        elif number == 2 and wire == _WIRE_VARINT:
            seq_id = _signed(value, 32)
    return model_id, seq_id


def _decode_datum(buf: bytes, index: int) -> ProtoDatum:
    where = f"data[{index}]"
    tokens: list[np.ndarray] = []
    inputs: dict[str, np.ndarray] = {}
    for number, _, value in iter_fields(buf):
        if number == 1:
            for cnum, _, cval in iter_fields(value):
                if cnum == 1:
                    raw = b""
                    for tnum, _, tval in iter_fields(cval):
                        if tnum == 1:
                            raw = tval
                    tokens.append(_array_from_bytes(raw, DTYPE_INT32, f"{where}.model_input"))
                elif cnum == 2:
                    raise ProtoError(f"{where}.model_input: image chunks are not supported (text models only)")
                elif cnum == 3:
                    raise ProtoError(f"{where}.model_input: audio (dmel) chunks are not supported")
        elif number == 2:
            key, _, val = _map_entry(value)
            inputs[key] = decode_tensor(val or b"", f"{where}.loss_fn_inputs.{key}")
    all_tokens = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    return ProtoDatum(all_tokens.astype(np.int64), inputs)


def decode_forward_backward_request(buf: bytes) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest()
    legacy: dict[str, float] = {}
    v2: dict[str, float | str] = {}
    for number, _wire, value in iter_fields(buf):
        if number == 1:
            req.model_id = _string(value, "model_id")
        elif number == 2:
            req.seq_id = _signed(value, 32)
        elif number == 3:
            req.data.append(_decode_datum(value, len(req.data)))
        elif number == 4:
            req.loss_fn = _string(value, "loss_fn")
        elif number == 5:
            key, vwire, val = _map_entry(value)
            legacy[key] = _double(vwire, val) if val is not None else 0.0
        elif number == 6:
            req.forward_only = bool(value)
        elif number == 7:
            key, _, val = _map_entry(value)
            entry: float | str = 0.0
            for vnum, vw, vv in iter_fields(val or b""):
                if vnum == 1:
                    entry = _double(vw, vv)
                elif vnum == 2:
                    entry = _string(vv, f"loss_fn_config.{key}")
            v2[key] = entry
    req.loss_fn_config = v2 if v2 else dict(legacy)  # v2 carries strings too; numbers are in both
    return req


# --- encoding --------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _len(number: int, payload: bytes) -> bytes:
    return _key(number, _WIRE_LEN) + _varint(len(payload)) + payload


def _uint(number: int, value: int) -> bytes:
    return _key(number, _WIRE_VARINT) + _varint(value) if value else b""


def _str(number: int, value: str) -> bytes:
    return _len(number, value.encode("utf-8")) if value else b""


def _packed_int64(number: int, values: list[int]) -> bytes:
    return _len(number, b"".join(_varint(v) for v in values)) if values else b""


def _map_double(number: int, items: dict[str, float]) -> bytes:
    return b"".join(_len(number, _str(1, k) + _key(2, _WIRE_I64) + struct.pack("<d", float(v)))
                    for k, v in items.items())


def _batched_tensor(arrays: list[np.ndarray]) -> bytes:
    """One field of an ArrayRecord: every datum's flat array concatenated, with int64 byte offsets."""
    is_float = not arrays or np.issubdtype(arrays[0].dtype, np.floating)
    np_dtype, enum = ("<f4", DTYPE_FLOAT32) if is_float else ("<i8", DTYPE_INT64)
    flat = [np.ascontiguousarray(a, dtype=np_dtype).reshape(-1) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype="<i8")
    np.cumsum([a.nbytes for a in flat], out=offsets[1:])
    data = b"".join(a.tobytes() for a in flat)
    return _len(1, data) + _len(2, offsets.tobytes()) + _uint(3, enum)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float],
                                   output_type: str = "ArrayRecord") -> bytes:
    """A ForwardBackwardOutput with one ArrayRecord holding every datum (1-D per-datum arrays)."""
    names = list(outputs[0]) if outputs else []
    fields = b"".join(
        _len(2, _str(1, name) + _len(2, _batched_tensor([o[name] for o in outputs]))) for name in names
    )
    record = _str(1, output_type) + fields + _uint(3, len(outputs))
    return _str(1, output_type) + _len(2, record) + _map_double(3, metrics)


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> bytes:
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = tok, lp
    return _len(1, ids.tobytes()) + _len(2, lps.tobytes()) + _uint(3, k) + _uint(4, len(rows))


def encode_sample_response(sequences: list[dict], prompt_logprobs: list[float | None] | None = None,
                           topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None,
                           topk_k: int = 0) -> bytes:
    """A SampleResponse. ``sequences``: dicts with stop_reason ("stop"/"length"), tokens, logprobs."""
    out = bytearray()
    for seq in sequences:
        body = _uint(1, STOP_REASON[seq["stop_reason"]])
        body += _len(2, np.asarray(seq["tokens"], dtype="<i4").tobytes())
        if seq.get("logprobs") is not None:
            body += _len(3, np.asarray(seq["logprobs"], dtype="<f4").tobytes())
        out += _len(1, body)
    if prompt_logprobs is not None:
        values = np.array([np.nan if v is None else v for v in prompt_logprobs], dtype="<f4")
        out += _len(2, values.tobytes())
    if topk_prompt_logprobs is not None and topk_k > 0:
        out += _len(3, _topk(topk_prompt_logprobs, topk_k))
    return bytes(out)
