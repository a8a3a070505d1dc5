"""MessagePack for the Actor plane's event bodies: bounded decoding of what clients send, encoding of answers.

Decoding refuses, before building any object, what no PyTRIO event needs and an attacker could use: a first pass
walks the bytes (iteratively, no objects made) and rejects nesting deeper than ``max_depth``, more than
``max_items`` objects, ext types, the reserved byte, truncated data and trailing bytes; then ``msgpack.Unpacker``
decodes with per-object limits on string, binary, array and map lengths. The msgpack library has no total-object
or depth bound of its own, which is why the first pass is written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
from pydantic import BaseModel

MEDIA_TYPE = "application/msgpack"


class MsgpackError(ValueError):
    """A body that cannot be decoded; ``code`` names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MsgpackLimits:
    max_body_bytes: int = 64 * 1024 * 1024
    max_depth: int = 16  # a forward_backward event nests 7 deep (envelope/payload/data/datum/input/chunks/chunk)
    max_items: int = 4 * 1024 * 1024  # objects in one body
    max_str_len: int = 1024 * 1024
    max_bin_len: int = 32 * 1024 * 1024
    max_array_len: int = 262_144
    max_map_len: int = 256


# leading byte -> bytes that follow it: fixed-size scalars, and length-prefixed str/bin (the prefix's width)
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXT = {0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8}


def scan(buf: bytes, limits: MsgpackLimits) -> None:
    """Check the structure of one msgpack object in ``buf`` without decoding it (see the module docstring)."""
    n, pos, items = len(buf), 0, 0
    view = memoryview(buf)
    stack = [1]  # objects still expected at each open level; the root expects one
    while stack:
        if pos >= n:
            raise MsgpackError("invalid_msgpack", "body: truncated msgpack")
        b = view[pos]
        pos += 1
        items += 1
        if items > limits.max_items:
            raise MsgpackError("body_too_complex", f"body: more than {limits.max_items} msgpack objects")
        stack[-1] -= 1
        children = 0
        if b <= 0x7F or b >= 0xE0:  # fixint
            pass
        elif b <= 0x8F:  # fixmap
            children = 2 * (b & 0x0F)
        elif b <= 0x9F:  # fixarray
            children = b & 0x0F
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width = _SIZED[b]
            pos += width + int.from_bytes(view[pos:pos + width], "big")
        elif b in (0xDC, 0xDD, 0xDE, 0xDF):  # array16/32, map16/32
            width = 2 if b in (0xDC, 0xDE) else 4
            children = int.from_bytes(view[pos:pos + width], "big") * (2 if b >= 0xDE else 1)
            pos += width
        elif b in _EXT:
            raise MsgpackError("invalid_msgpack", "body: msgpack ext types are not accepted")
        else:
            raise MsgpackError("invalid_msgpack", f"body: invalid msgpack byte 0x{b:02x} at offset {pos - 1}")
        if pos > n:
            raise MsgpackError("invalid_msgpack", "body: truncated msgpack")
        if children:
            if len(stack) > limits.max_depth:  # the root level plus the containers already open
                raise MsgpackError("body_too_deep", f"body: msgpack nested deeper than {limits.max_depth} levels")
            stack.append(children)
        while stack and stack[-1] == 0:
            stack.pop()
    if pos != n:
        raise MsgpackError("invalid_msgpack", f"body: {n - pos} trailing bytes after the msgpack object")


def decode(buf: bytes, limits: MsgpackLimits) -> Any:
    """One msgpack object, decoded within ``limits`` (MsgpackError otherwise). Maps need string keys."""
    if len(buf) > limits.max_body_bytes:
        raise MsgpackError("body_too_large", f"body: over {limits.max_body_bytes} bytes")
    if not buf:
        raise MsgpackError("invalid_msgpack", "body: empty")
    scan(buf, limits)
    unpacker = msgpack.Unpacker(None, raw=False, strict_map_key=True, use_list=True, max_buffer_size=len(buf),
                                max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
                                max_array_len=limits.max_array_len, max_map_len=limits.max_map_len, max_ext_len=0)
    unpacker.feed(buf)
    try:
        return unpacker.unpack()
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            msgpack.OutOfData) as exc:
        raise MsgpackError("invalid_msgpack", f"body: cannot decode msgpack ({type(exc).__name__}: {exc})") from None


def encode(answer: BaseModel) -> bytes:
    """An answer as msgpack: bytes fields become ``bin`` (tensors), floats float64, None-valued keys left out."""
    return msgpack.packb(answer.model_dump(mode="python", exclude_none=True), use_bin_type=True)
