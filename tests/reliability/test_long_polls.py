"""Held long polls are bounded per tenant, and never keep a new connection out (api/long_polls.py, connections.py):
past ``--max-long-polls-per-tenant`` a tenant's oldest poll is answered "not ready, poll again" at once, another
tenant's polls untouched; with every connection a complete long poll, a new client is admitted by ending one
(before: 503 for everyone). Unit tests of the registry, then Tinker ``retrieve_future`` polls on futures waiting
for a seq_id gap (each held 30 s unless ended) on an in-process worker with the connection guard."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import replace

import httpx
import pytest

from server_mock.api.auth import tenant_id
from server_mock.api.long_polls import LongPolls
from server_mock.config import Limits

from .bounded_worker import bounded_worker
from .reliability_helpers import KEY_A, KEY_B

pytest.importorskip("tinker")


def test_the_oldest_poll_of_a_tenant_past_its_cap_ends_and_others_are_untouched():
    async def scenario():
        polls = LongPolls(per_tenant=3)
        never = [asyncio.Event() for _ in range(5)]
        a = [asyncio.ensure_future(polls.hold("a", "10.0.0.1", never[i].wait())) for i in range(3)]
        b = asyncio.ensure_future(polls.hold("b", "10.0.0.2", never[3].wait()))
        await asyncio.sleep(0)
        assert (polls.held("a"), polls.held("b"), polls.ended_early) == (3, 1, 0)  # exactly at the cap
        fourth = asyncio.ensure_future(polls.hold("a", "10.0.0.1", never[4].wait()))
        await asyncio.sleep(0)
        assert await asyncio.wait_for(a[0], 5) is False  # ended early: the caller answers "not ready"
        assert not any(t.done() for t in (*a[1:], b, fourth))
        assert (polls.held("a"), polls.held("b"), polls.ended_early) == (3, 1, 1)
        never[1].set()
        assert await asyncio.wait_for(a[1], 5) is True  # one that ends by itself
        assert polls.relieve("10.0.0.2") is True and await asyncio.wait_for(b, 5) is False
        assert polls.relieve("10.0.0.9") is False
        assert polls.relieve(None) is True and await asyncio.wait_for(a[2], 5) is False  # the busiest tenant's
        assert polls.relieve(None) is True and await asyncio.wait_for(fourth, 5) is False
        assert polls.relieve(None) is False and polls.held("a") == 0

    asyncio.run(scenario())


def test_ending_a_poll_never_cancels_the_work_it_waits_for():
    async def scenario():
        polls = LongPolls(per_tenant=1)
        work = asyncio.ensure_future(asyncio.sleep(30))
        first = asyncio.ensure_future(polls.hold("a", "", asyncio.wait({work}, timeout=30)))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(polls.hold("a", "", asyncio.wait({work}, timeout=30)))
        assert await asyncio.wait_for(first, 5) is False
        assert not work.cancelled() and not work.done()
        work.cancel()
        await asyncio.wait_for(second, 5)

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    with bounded_worker(tiny_model_dir, tmp_path_factory.mktemp("polls"),
                        replace(Limits(), max_long_polls_per_tenant=3)) as running:
        yield running


class Tenant:
    """A Tinker model of one key with a forward_backward at seq_id 2: its future waits for seq_id 1."""

    def __init__(self, url: str, key: str) -> None:
        from tinker import types
        from tinker.proto.request_conv import forward_backward_request_to_proto

        self.url, self.key = url + "/api/v1", key
        with self.client() as http:
            session = http.post("/create_session", json={"tags": [], "type": "create_session"}).json()["session_id"]
            created = http.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": "tiny", "lora_config": {"rank": 2},
                                                       "type": "create_model"}).json()
            self.model_id = created["model_id"]
            while self.poll(created["request_id"]).get("type") == "try_again":
                pass

            def body(seq_id: int) -> bytes:
                data = [types.Datum(model_input=types.ModelInput.from_ints([5, 9, 14]),
                                    loss_fn_inputs={"target_tokens": [9, 14, 20]})]
                return forward_backward_request_to_proto(types.ForwardBackwardRequest(
                    forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                    model_id=self.model_id, seq_id=seq_id)).SerializeToString()

            self.body = body
            sent = http.post("/forward_backward", content=body(2), headers={"Content-Type": "application/x-protobuf"})
            assert sent.status_code == 200, sent.text
            self.waiting = sent.json()["request_id"]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, timeout=60)

    def poll(self, request_id: str | None = None):
        """One retrieve_future on a connection of its own: "try_again", or the answer (bytes: an output)."""
        with self.client() as http:
            answer = http.post("/retrieve_future", json={"request_id": request_id or self.waiting,
                                                         "allow_metadata_only": True},
                               headers={"Accept": "application/x-protobuf"})
            assert answer.status_code == 200, answer.text
            return answer.content if "protobuf" in answer.headers["content-type"] else answer.json()

    def fill_gap(self) -> None:
        with self.client() as http:
            sent = http.post("/forward_backward", content=self.body(1),
                             headers={"Content-Type": "application/x-protobuf"})
            assert sent.status_code == 200, sent.text


def until(condition, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError(f"never: {what}")


def test_tinker_polls_at_the_cap_and_one_past_another_tenant_served(worker):
    polls = worker.app.state.long_polls
    a, b = Tenant(worker.url, KEY_A), Tenant(worker.url, KEY_B)
    ta, tb = tenant_id(KEY_A), tenant_id(KEY_B)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        held = []
        for _ in range(3):
            held.append(pool.submit(a.poll))
            until(lambda: polls.held(ta) == len(held), "a's polls held")
        other = pool.submit(b.poll)
        until(lambda: polls.held(tb) == 1, "b's poll held")
        ended = polls.ended_early
        assert not any(f.done() for f in held)  # exactly at the cap: all held
        held.append(pool.submit(a.poll))  # one past
        assert held[0].result(timeout=20) == {"type": "try_again", "request_id": a.waiting, "queue_state": "active"}
        assert polls.ended_early == ended + 1 and polls.held(ta) == 3
        assert not other.done() and not any(f.done() for f in held[1:])
        a.fill_gap()
        b.fill_gap()
        assert all(isinstance(f.result(timeout=30), bytes) for f in held[1:])  # the outputs, once the gap is filled
        assert isinstance(other.result(timeout=30), bytes)


def test_complete_long_polls_never_fill_the_connections(worker):
    """Six connections allowed, all six held by tenant A's polls (under its cap of 100): B's new connection is
    admitted by ending A's oldest poll, and answered; nobody gets 503."""
    polls, guard = worker.app.state.long_polls, worker.guard
    polls.per_tenant, guard.max_open = 100, 6
    try:
        until(lambda: guard.open == 0, "earlier connections closed")
        a = Tenant(worker.url, KEY_A)
        until(lambda: guard.open == 0, "setup connections closed")
        refused, ended = guard.refused, polls.ended_early
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            held = []
            for _ in range(6):
                held.append(pool.submit(a.poll))
                until(lambda: polls.held(tenant_id(KEY_A)) == len(held), "a's polls held")
            assert guard.open == 6
            health = httpx.get(worker.url + "/v1/health", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=20)
            assert health.status_code == 200, health.text
            assert guard.refused == refused and guard.relieved >= 1 and polls.ended_early >= ended + 1
            assert held[0].result(timeout=20)["type"] == "try_again"
            a.fill_gap()
            assert all(isinstance(f.result(timeout=30), bytes) for f in held[1:])
    finally:
        polls.per_tenant, guard.max_open = 3, guard.options.max_connections
