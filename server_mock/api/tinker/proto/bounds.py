"""A bound on what parsing a protobuf body builds, checked before the protobuf runtime parses it.

The runtime allocates ~50 bytes for every message it meets, however small: a 64 MiB body of empty ``Datum``s (two
bytes each) would become 32 million messages. No protobuf API bounds a repeated field while parsing, so
``count_fields`` walks the body's wire format (tags and lengths only, guided by the message descriptors, never
copying a payload) and stops as soon as it has seen more fields than allowed. A body that does not walk cleanly
is left to the runtime, which reports why it is not a message.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_MESSAGE = FieldDescriptor.TYPE_MESSAGE


class TooManyFields(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"holds more than {limit} protobuf fields")
        self.limit = limit


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def count_fields(buf: bytes, descriptor: Descriptor, limit: int) -> int:
    """The number of fields in ``buf`` (a serialized ``descriptor`` message), counting those of every nested
    message and map entry; ``TooManyFields`` as soon as it passes ``limit``. Stops quietly (returning the count
    so far) at anything malformed."""
    count = 0
    stack = [(0, len(buf), descriptor)]
    try:
        while stack:
            pos, end, message = stack.pop()
            fields = message.fields_by_number
            while pos < end:
                key, pos = _varint(buf, pos)
                count += 1
                if count > limit:
                    raise TooManyFields(limit)
                wire_type = key & 7
                if wire_type == 0:
                    _, pos = _varint(buf, pos)
                elif wire_type == 2:
                    length, pos = _varint(buf, pos)
                    field = fields.get(key >> 3)
                    if field is not None and field.type == _MESSAGE and length:
                        stack.append((pos, pos + length, field.message_type))
                    pos += length
                elif wire_type == 1:
                    pos += 8
                elif wire_type == 5:
                    pos += 4
                else:
                    return count  # groups or garbage: the runtime will say what is wrong
    except (IndexError, ValueError) as exc:
        if isinstance(exc, TooManyFields):
            raise
    return count
