"""Request bodies being received cost what has arrived, never what a Content-Length announces, and what they hold
is bounded per tenant and on the worker (api/body_budget.py). Each test drives a small Starlette app through raw
ASGI calls: the real ``read_body`` behind the real endpoint wrapper (which charges the body to the caller's tenant)
and the native error answers, with bodies whose bytes the test hands over when it likes."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from server_mock.api import bodies
from server_mock.api import endpoint as api_endpoint
from server_mock.api.native.endpoint import error_response
from server_mock.cli import check_limits
from server_mock.config import Limits

MIB = 1 << 20


def make_app(total: int | None = None, per_tenant: int | None = None) -> Starlette:
    limit = bodies.tensor_limit(Limits())

    async def handler(request, tenant):
        raw = await bodies.read_body(request, limit, json_values=False)
        return JSONResponse({"size": len(raw), "head": bytes(raw[:8]).hex(), "tail": bytes(raw[-8:]).hex()})

    route = api_endpoint.endpoint(handler, tenant_of=lambda r: r.headers["authorization"],
                                  render_error=error_response)
    app = Starlette(routes=[Route("/ops", route, methods=["POST"])])
    if total is not None:
        from server_mock.api.body_budget import BodyBudget

        app.state.body_budget = BodyBudget(total, per_tenant)
    return app


class Call:
    """One request to ``app``: its body handed over by ``send_body``; ``answer()`` waits for its status and JSON."""

    def __init__(self, app: Starlette, tenant: str, declared: int | None) -> None:
        headers = [(b"authorization", tenant.encode()), (b"content-type", b"application/octet-stream")]
        if declared is not None:
            headers.append((b"content-length", str(declared).encode()))
        else:
            headers.append((b"transfer-encoding", b"chunked"))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/ops", "raw_path": b"/ops", "query_string": b"", "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.waiting = 0  # receive() calls not answered yet
        self.sent: list[dict] = []
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict:
        self.waiting += 1
        try:
            return await self.incoming.get()
        finally:
            self.waiting -= 1

    async def _send(self, message: dict) -> None:
        self.sent.append(message)

    def send_body(self, data: bytes, more: bool = False) -> None:
        self.incoming.put_nowait({"type": "http.request", "body": data, "more_body": more})

    async def answer(self) -> tuple[int, dict, dict]:
        await asyncio.wait_for(self.task, 30)
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(body)


async def blocked(*calls: Call) -> None:
    """Until each call waits for body bytes that have not come."""
    for _ in range(1000):
        if all(c.waiting or c.task.done() for c in calls):
            return
        await asyncio.sleep(0)
    raise AssertionError("the requests never waited for their bodies")


def test_announced_bodies_hold_no_memory():
    """Four requests announcing 64 MiB each (the largest allowed body) and sending nothing allocate nothing for
    it (before: a zeroed 64 MiB buffer each, as soon as the headers arrived)."""

    async def scenario():
        app = make_app()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            calls = [Call(app, "a", 64 * MIB) for _ in range(4)]
            await blocked(*calls)
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        for call in calls:
            call.task.cancel()
        await asyncio.gather(*(c.task for c in calls), return_exceptions=True)
        return held

    held = asyncio.run(scenario())
    assert held < 1 * MIB, f"4 announced 64 MiB bodies hold {held} bytes before any of their bytes came"


@pytest.mark.parametrize("declared", [True, False])
def test_a_large_body_arrives_whole(declared):
    """A 3 MiB body in 64 KiB chunks (with and without a Content-Length) is received byte for byte."""
    data = bytes(range(256)) * (3 * MIB // 256) + b"end"

    async def scenario():
        call = Call(make_app(1 << 30, 256 * MIB), "a", len(data) if declared else None)
        for at in range(0, len(data), 64 * 1024):
            call.send_body(data[at:at + 64 * 1024], more=True)
        call.send_body(b"")
        return await call.answer()

    status, _, answer = asyncio.run(scenario())
    assert status == 200
    assert answer == {"size": len(data), "head": data[:8].hex(), "tail": data[-8:].hex()}


def test_tenant_budget_at_the_limit_and_one_past():
    """Per-tenant budget 1000: 600 + 400 announced is exactly the limit and is received; 600 + 401 is refused
    429 with Retry-After naming the flag, before any byte of it is read; what was held is given back."""

    async def scenario():
        app = make_app(total=10_000, per_tenant=1000)
        budget = app.state.body_budget
        first = Call(app, "a", 600)
        await blocked(first)
        assert budget.by_tenant == {"a": 600}
        over = Call(app, "a", 401)
        status, headers, answer = await over.answer()
        assert status == 429 and headers["retry-after"] == "1"
        assert answer["error"]["code"] == "body_budget_exceeded" and answer["error"]["field"] == "body"
        assert "max_body_bytes_in_flight_per_tenant=1000" in answer["error"]["message"]
        assert "--max-body-bytes-in-flight-per-tenant" in answer["error"]["message"]
        assert budget.by_tenant == {"a": 600}  # the refusal changed nothing
        other = Call(app, "b", 1000)  # another tenant has its own share
        at_limit = Call(app, "a", 400)
        await blocked(other, at_limit)
        assert budget.by_tenant == {"a": 1000, "b": 1000} and budget.held == 2000
        for call, size in ((first, 600), (at_limit, 400), (other, 1000)):
            call.send_body(b"x" * size)
            assert (await call.answer())[0] == 200
        assert budget.held == 0 and budget.by_tenant == {}

    asyncio.run(scenario())


def test_worker_budget_at_the_limit_and_one_past():
    """Worker budget 1500 (per tenant 1000): 600 (a) + 900 (b) is exactly the limit; one more byte from a third
    tenant is refused naming --max-body-bytes-in-flight."""

    async def scenario():
        app = make_app(total=1500, per_tenant=1000)
        a, b = Call(app, "a", 600), Call(app, "b", 900)
        await blocked(a, b)
        assert app.state.body_budget.held == 1500
        status, headers, answer = await Call(app, "c", 1).answer()
        assert status == 429 and "retry-after" in headers
        assert "max_body_bytes_in_flight=1500 (--max-body-bytes-in-flight)" in answer["error"]["message"]
        a.send_body(b"x" * 600)
        assert (await a.answer())[0] == 200
        c = Call(app, "c", 600)  # room again
        c.send_body(b"y" * 600)
        assert (await c.answer())[0] == 200
        b.task.cancel()
        await asyncio.gather(b.task, return_exceptions=True)
        assert app.state.body_budget.held == 0  # a request that went away gives back what it held

    asyncio.run(scenario())


def test_chunked_body_is_charged_as_it_arrives():
    """Without a Content-Length the bytes count as they come: 1000 of 1000 arrive; the 1001st byte is refused."""

    async def scenario():
        app = make_app(total=10_000, per_tenant=1000)
        ok = Call(app, "a", None)
        ok.send_body(b"x" * 500, more=True)
        ok.send_body(b"x" * 500)
        assert (await ok.answer())[0:3:2] == (200, {"size": 1000, "head": "78" * 8, "tail": "78" * 8})
        over = Call(app, "a", None)
        over.send_body(b"x" * 1000, more=True)
        await blocked(over)
        assert app.state.body_budget.held == 1000
        over.send_body(b"x")
        status, _, answer = await over.answer()
        assert status == 429 and "max_body_bytes_in_flight_per_tenant=1000" in answer["error"]["message"]
        assert app.state.body_budget.held == 0

    asyncio.run(scenario())


def test_budgets_smaller_than_the_largest_body_are_refused_at_start():
    assert check_limits(Limits()) is None
    assert check_limits(Limits(max_body_bytes_in_flight_per_tenant=64 * MIB)) is None  # exactly the largest body
    problem = check_limits(Limits(max_body_bytes_in_flight_per_tenant=64 * MIB - 1))
    assert problem and "--max-body-bytes-in-flight-per-tenant" in problem and "--max-body-bytes" in problem
    assert check_limits(Limits(max_body_bytes_in_flight=64 * MIB - 1)) is not None


def test_the_pytrio_control_plane_keeps_the_budget_a_retry():
    """PyTRIO Control answers a per-key 429 as a final 409; a full body budget passes, so that the SDK retries."""
    from server_mock.api.body_budget import BodyBudget
    from server_mock.api.pytrio.endpoint import control_error
    from server_mock.errors import WorkerError

    budget = BodyBudget(100, 100)
    with pytest.raises(WorkerError) as err:
        budget.hold("a").grow_to(101)
    assert control_error(err.value).status_code == 429
    assert control_error(WorkerError(429, "too_many_sessions", "x")).status_code == 409
