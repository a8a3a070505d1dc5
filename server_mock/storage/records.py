"""Request results and op payloads as bytes for the durable store: msgpack, with numpy arrays as typed binary
(dtype, shape, little-endian bytes), with no pickle anywhere; ``pack`` and ``unpack`` round-trip dicts, lists, strings,
numbers, booleans, None and numpy arrays exactly (bit for bit)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

_ARRAY = 1  # msgpack extension type of a numpy array
_DTYPES = {"<f4", "<f8", "<i8", "<i4", "<u2", "|b1", "<u4", "|u1"}  # what the worker stores; refused otherwise


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        arr = arr.astype(dtype, copy=False)
        header = msgpack.packb([dtype.str, list(arr.shape)])
        return msgpack.ExtType(_ARRAY, header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot store a {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _ARRAY:
        raise ValueError(f"unknown record extension {code}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    if dtype not in _DTYPES:
        raise ValueError(f"record array dtype {dtype!r} is not one the worker stores")
    offset = unpacker.tell()
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape).copy()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, ext_hook=_ext_hook, raw=False, strict_map_key=False)
