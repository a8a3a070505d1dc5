"""Request bodies, for every protocol: read within a size limit (optionally zstd-compressed, within a ratio), and
parsed as JSON or into a pydantic model, off the event loop when large and then behind a worker-wide byte budget.

What a body may cost is bounded before it is parsed:
- its size: ``--max-json-body-bytes`` for JSON bodies, ``--max-body-bytes`` on the routes that carry tensors
  (``BodyLimit``); a zstd body may expand to at most ``--max-zstd-ratio`` times its size (and the size limit);
- its JSON values: at most ``--max-json-values`` (numbers, strings, list items, object members), counted from
  its commas and brackets before any parser sees it, because a parse holds ~60 bytes per value whatever it is;
- what is parsed at once: bodies over ``BIG_BODY_BYTES`` are parsed in worker threads, together at most
  ``--max-parsing-bytes`` (counted as their size plus ``BYTES_PER_VALUE`` per JSON value); others wait;
- what bodies being received hold: at most ``--max-body-bytes-in-flight`` bytes, and
  ``--max-body-bytes-in-flight-per-tenant`` of one key (``body_budget``); a buffer grows only with the bytes that
  arrive, whatever the Content-Length says;
- what a refusal costs: the request shapes stop at their first bad item (``fail_fast``, ``max_length``), and
  only the first error is ever turned into a message (``first_error``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request

from server_mock.api.body_budget import TENANT_SCOPE_KEY, BodyHold
from server_mock.config import Limits
from server_mock.errors import WorkerError

BIG_BODY_BYTES = 1 << 20  # bodies above this are joined and parsed off the event loop
OFF_LOOP_VALUES = 1 << 14  # ... and so are smaller ones with more JSON values than this (each may be an object)
BYTES_PER_VALUE = 64  # about what a JSON parse allocates per value (pydantic-core's tree; Python's is larger)
ZSTD_FLOOR_BYTES = 1 << 20  # a zstd body may always expand to this much, whatever its ratio
MAX_REPORTED_ERRORS = 64  # a ValidationError with more errors than this is not turned into dicts at all


@dataclass(frozen=True)
class BodyLimit:
    """What one route's bodies may hold: ``size`` bytes (after decompression; ``name`` is the limit's name in the
    413), ``values`` JSON values, and a zstd expansion of at most ``zstd_ratio`` times."""

    size: int
    name: str
    values: int
    zstd_ratio: int
    values_name: str = "limit max_json_values"


def json_limit(limits: Limits) -> BodyLimit:
    """The limit of a JSON body (every route but those carrying tensors): the smaller of the two size limits."""
    if limits.max_body_bytes < limits.max_json_body_bytes:
        return BodyLimit(limits.max_body_bytes, "max_body_bytes", limits.max_json_values, limits.max_zstd_ratio)
    return BodyLimit(limits.max_json_body_bytes, "max_json_body_bytes", limits.max_json_values, limits.max_zstd_ratio)


TENSOR_VALUES_FACTOR = 4  # a body carrying tensors holds ~20 JSON values a datum: 4x a JSON body's count


def tensor_limit(limits: Limits) -> BodyLimit:
    """The limit of a body that carries tensors (native training ops, Tinker forward_backward)."""
    return BodyLimit(limits.max_body_bytes, "max_body_bytes", TENSOR_VALUES_FACTOR * limits.max_json_values,
                     limits.max_zstd_ratio, f"{TENSOR_VALUES_FACTOR} x limit max_json_values")


def as_limit(request: Request, limit: BodyLimit | int) -> BodyLimit:
    """``limit`` as a ``BodyLimit``; a plain size (a route with a limit of its own) counts values as a tensor
    route does, from the worker's limits."""
    if isinstance(limit, BodyLimit):
        return limit
    service = getattr(request.app.state, "service", None)
    values = TENSOR_VALUES_FACTOR * (service.limits.max_json_values if service is not None else 1 << 16)
    ratio = service.limits.max_zstd_ratio if service is not None else 100
    return BodyLimit(limit, "max_body_bytes", values, ratio, f"{TENSOR_VALUES_FACTOR} x limit max_json_values")


def _too_large(limit: BodyLimit, declared: str | None = None, what: str = "") -> WorkerError:
    size = f"{declared} bytes exceeds" if declared is not None else "exceeds"
    return WorkerError(413, "body_too_large", f"body: {size} limit {limit.name}={limit.size}{what}", "body")


class ParseBudget:
    """Bytes of request bodies being decompressed or parsed in worker threads at once, all requests together.
    Waiters are served in arrival order; one body larger than the whole budget takes all of it."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.held = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        size = max(0, min(size, self.limit))
        if self._waiting or self.held + size > self.limit:
            granted = asyncio.get_running_loop().create_future()
            entry = (size, granted)
            self._waiting.append(entry)
            try:
                await granted
            except BaseException:
                if granted.done() and not granted.cancelled():
                    self._release(size)  # granted just as it was cancelled
                else:
                    self._waiting.remove(entry)
                    self._wake()
                raise
        else:
            self.held += size
        try:
            yield
        finally:
            self._release(size)

    def _release(self, size: int) -> None:
        self.held -= size
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self.held + self._waiting[0][0] <= self.limit:
            size, granted = self._waiting.popleft()
            self.held += size
            granted.set_result(None)


def parse_budget(request: Request) -> ParseBudget | None:
    return getattr(request.app.state, "parse_budget", None)


@contextlib.asynccontextmanager
async def parsing(request: Request, size: int) -> AsyncIterator[None]:
    """Hold ``size`` bytes of the worker's parse budget while a large body is decompressed or parsed."""
    budget = parse_budget(request)
    if budget is None:
        yield
        return
    async with budget.hold(size):
        yield


async def read_body(request: Request, limit: BodyLimit | int, *, allow_zstd: bool = False, json_values: bool = True
                    ) -> bytes | bytearray:
    """The body's bytes, at most ``limit.size`` of them (413 naming the limit). With ``allow_zstd``, a body sent
    with ``Content-Encoding: zstd`` is decompressed: the limit applies to what it decompresses to, and that may
    be at most ``limit.zstd_ratio`` times the compressed size (beyond ``ZSTD_FLOOR_BYTES``). With ``json_values``
    (a JSON body), its values are counted as it arrives, and one with more than ``limit.values`` is refused
    before the rest of it is read (a plain size as ``limit``: a body that need not be JSON, not counted).
    While it is received the body holds its share of the worker's body budget (``body_budget``): its
    Content-Length from the start, and its bytes only as they arrive (429 past the budget)."""
    if not isinstance(limit, BodyLimit):
        limit, json_values = as_limit(request, limit), False
    header = request.headers.get("content-length")
    declared = int(header) if header is not None and header.isdigit() else None
    if declared is not None and declared > limit.size:
        raise _too_large(limit, header)
    compressed = allow_zstd and request.headers.get("content-encoding", "").lower() == "zstd"
    values = _ValueCount(limit) if json_values and not compressed else None
    budget = getattr(request.app.state, "body_budget", None) if "app" in request.scope else None
    hold = budget.hold(request.scope.get(TENANT_SCOPE_KEY, "")) if budget is not None else None
    try:
        if hold is not None and declared is not None:
            hold.grow_to(declared)  # counted, not allocated: the buffer grows only with what arrives
        raw = await _receive(request, declared, limit, values, hold)
    finally:
        if hold is not None:
            hold.release()
    if compressed:
        cap = min(limit.size, max(ZSTD_FLOOR_BYTES, limit.zstd_ratio * len(raw)))
        async with parsing(request, cap):
            raw = await asyncio.to_thread(_unzstd, raw, limit, cap)
    return raw


class _ValueCount:
    """``json_values`` of a body counted chunk by chunk as it arrives; 413 once past the limit."""

    def __init__(self, limit: BodyLimit) -> None:
        self.limit, self.seen = limit, 1

    def add(self, chunk: bytes) -> None:
        self.seen += chunk.count(b",") + chunk.count(b"[") + chunk.count(b"{")
        if self.seen > self.limit.values:
            raise WorkerError(413, "body_too_large", f"body: holds more than {self.limit.values} JSON values "
                                                     f"(counted from its commas and brackets; "
                                                     f"{_values_limit(self.limit)}); refused before the rest was read",
                              "body")


async def _receive(request: Request, declared: int | None, limit: BodyLimit, values: _ValueCount | None,
                   hold: BodyHold | None) -> bytes | bytearray:
    """The body as it arrives: small ones as their chunks joined, large ones (over ``BIG_BODY_BYTES``) grown in
    one buffer chunk by chunk, never allocated ahead from the declared length."""
    chunks: list[bytes] = []
    buffer: bytearray | None = None
    size = 0
    async for chunk in request.stream():
        if not chunk:
            continue
        size += len(chunk)
        if size > limit.size:
            raise _too_large(limit)
        if declared is not None and size > declared:  # the HTTP layer does not allow it; never take more
            raise WorkerError(400, "invalid_body", "body: longer than its Content-Length", "body")
        if hold is not None:
            hold.grow_to(size)  # a no-op within the declared length
        if values is not None:
            values.add(chunk)
        if buffer is not None:
            buffer += chunk
        elif size > BIG_BODY_BYTES:  # from here on one buffer, not chunks and a join
            buffer = bytearray().join(chunks) if chunks else bytearray()
            buffer += chunk
            chunks = []
        else:
            chunks.append(chunk)
    if buffer is not None:
        return buffer
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _unzstd(raw: bytes, limit: BodyLimit, cap: int) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise WorkerError(415, "unsupported_encoding", "zstd bodies need the zstandard package on the worker") from None
    try:
        out = zstandard.ZstdDecompressor().stream_reader(raw).read(cap + 1)
    except zstandard.ZstdError as exc:
        raise WorkerError(400, "invalid_encoding", f"body: not valid zstd ({exc})") from None
    if len(out) > cap:
        if cap == limit.size:
            raise _too_large(limit, what=" uncompressed")
        raise WorkerError(413, "body_too_large", f"body: {len(raw)} compressed bytes expand to more than {cap} "
                                                 f"(limit max_zstd_ratio={limit.zstd_ratio}: a zstd body may expand "
                                                 f"to {limit.zstd_ratio}x its size, or {ZSTD_FLOOR_BYTES} bytes)",
                          "body")
    return out


def _values_limit(limit: BodyLimit) -> str:
    if limit.values_name.startswith(f"{TENSOR_VALUES_FACTOR} x"):
        return f"{limit.values_name}={limit.values // TENSOR_VALUES_FACTOR}"
    return f"{limit.values_name}={limit.values}"


def json_values(raw: bytes) -> int:
    """An upper bound on the JSON values in ``raw``: every value but the first of a list or object follows a comma,
    and every list or object opens with a bracket (a comma or bracket inside a string counts too). Counted with
    bytes.count, at memory speed, because no JSON parser offers a bound on what it builds."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def check_values(raw: bytes, limit: BodyLimit) -> int:
    """The bound on ``raw``'s JSON values (0 when it is too small to matter); 413 when it is over the limit."""
    if len(raw) <= limit.values:  # a value takes at least one byte
        return 0
    values = json_values(raw)
    if values > limit.values:
        raise WorkerError(413, "body_too_large", f"body: holds more than {limit.values} JSON values (counted from "
                                                 f"its commas and brackets: {values}; {_values_limit(limit)})", "body")
    return values


def parse_json(raw: bytes, empty: Any = None, limit: BodyLimit | None = None) -> Any:
    """``raw`` as JSON (``empty`` for an empty body); 400 naming the body if it is not JSON, 413 if it holds more
    values than ``limit`` allows."""
    if limit is not None:
        check_values(raw, limit)
    try:
        return json.loads(raw) if raw else empty
    except ValueError:
        raise WorkerError(400, "invalid_json", "body: not valid JSON", "body") from None
    except RecursionError:
        raise WorkerError(400, "invalid_json", "body: JSON nested too deeply", "body") from None


async def read_json(request: Request, limit: BodyLimit | int, *, allow_zstd: bool = False, empty: Any = None
                    ) -> tuple[Any, bytes]:
    """The body parsed as JSON (off the event loop and within the parse budget when large), and its bytes."""
    limit = as_limit(request, limit)
    raw = await read_body(request, limit, allow_zstd=allow_zstd)
    if off_loop(raw):
        async with parsing(request, await asyncio.to_thread(parse_cost, raw, limit)):
            return await asyncio.to_thread(parse_json, raw, empty), raw  # its values were counted by parse_cost
    return parse_json(raw, empty, limit), raw


def off_loop(raw: bytes) -> bool:
    """Whether parsing ``raw`` may take long enough to belong in a worker thread: a large body, or one holding
    many JSON values (a list of 100000 small objects costs a parser far more than its bytes suggest)."""
    return len(raw) > BIG_BODY_BYTES or (len(raw) > OFF_LOOP_VALUES and json_values(raw) > OFF_LOOP_VALUES)


def parse_cost(raw: bytes, limit: BodyLimit) -> int:
    """What parsing ``raw`` holds, for the parse budget: its size, and ``BYTES_PER_VALUE`` per JSON value (413 when
    it holds more values than ``limit`` allows)."""
    values = check_values(raw, limit) or json_values(raw)
    return len(raw) + BYTES_PER_VALUE * values


def first_error(exc: PydanticValidationError) -> dict:
    """The first error of a validation failure, as pydantic describes it (``loc``, ``type``, ``msg``, ``input``),
    without building the others: a failure with many errors is summarised instead."""
    count = exc.error_count()
    if count > MAX_REPORTED_ERRORS:
        return {"loc": (), "type": "too_many_errors", "msg": f"{count} invalid values", "input": None}
    # the inputs are made Python objects only when asked for: not when one may be a whole over-long list
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    if not errors:
        return {"loc": (), "type": "invalid", "msg": "invalid", "input": None}
    if any(e["type"] in ("too_long", "too_short") for e in errors):
        return {**errors[0], "input": None}
    return exc.errors(include_url=False, include_context=False)[0]


def dotted(loc: tuple) -> str:
    """A pydantic error location as ``a.b.0.c`` (union and validator tags dropped)."""
    return ".".join(str(p) for p in loc if not str(p).startswith("function-"))


def parse_body(model: type[BaseModel], raw: bytes, limit: BodyLimit | None = None) -> BaseModel:
    """``raw`` validated into ``model``; 400 for JSON that does not parse, 413 for a body with more JSON values than
    ``limit`` allows, 422 naming the first bad field."""
    if limit is not None:
        check_values(raw, limit)
    try:
        return model.model_validate_json(raw)
    except PydanticValidationError as exc:
        first = first_error(exc)
        if first.get("type") in ("json_invalid", "json_type"):  # lone surrogate escapes (\ud800) are refused here
            why = first.get("msg", "").removeprefix("Invalid JSON: ")
            raise WorkerError(400, "invalid_json", f"body: not valid JSON (or not UTF-8): {why}", "body") from None
        loc = dotted(first.get("loc", ()))
        raise WorkerError(422, "invalid_request_body", f"{loc or 'body'}: {first.get('msg', 'invalid')}",
                          loc or "body") from None


async def read_model(request: Request, model: type[BaseModel], limit: BodyLimit, *, allow_zstd: bool = False
                     ) -> BaseModel:
    """The body validated into ``model`` (off the event loop and within the parse budget when large)."""
    return (await read_model_raw(request, model, limit, allow_zstd=allow_zstd))[0]


async def read_model_raw(request: Request, model: type[BaseModel], limit: BodyLimit, *, allow_zstd: bool = False,
                         parse=None) -> tuple[Any, bytes]:
    """``read_model``, and the body's bytes; ``parse(model, raw, limit)`` replaces ``parse_body``."""
    limit = as_limit(request, limit)
    raw = await read_body(request, limit, allow_zstd=allow_zstd)
    return await parse_raw(request, model, raw, limit, parse), raw


async def parse_raw(request: Request, model: type[BaseModel], raw: bytes, limit: BodyLimit, parse=None) -> Any:
    """``raw`` validated into ``model`` by ``parse(model, raw, limit)`` (``parse_body`` by default): in a worker
    thread, within the parse budget, when it is large."""
    parse = parse or parse_body
    if off_loop(raw):
        async with parsing(request, await asyncio.to_thread(parse_cost, raw, limit)):
            return await asyncio.to_thread(parse, model, raw, None)  # its values were counted by parse_cost
    return parse(model, raw, limit)
