"""PyTRIO answers kept for polls and retries count in the key's --max-result-bytes (api/pytrio/kept_answers.py):
finished event answers of all its training runs and remembered sample answers of its sampling runs together;
past it the oldest is forgotten (the newest always stays). Before, 98 forward answers of one run held 6x the
budget and none of it was counted. Unit tests of the budget at the limit and one past, then raw PyTRIO traffic
on an in-process worker."""

from __future__ import annotations

import secrets

import httpx
import msgpack
import pytest

from server_mock.api.auth import tenant_id
from server_mock.api.pytrio.kept_answers import KeptAnswers
from server_mock.config import Limits

from .bounded_worker import bounded_worker
from .reliability_helpers import KEY_A, KEY_B


def test_kept_answers_at_the_limit_and_one_past():
    gone = []
    kept = KeptAnswers(limit=300)
    for key, size in (("x", 100), ("y", 200)):
        kept.keep("a", key, size, lambda key=key: gone.append(key))
    kept.keep("b", "z", 300, lambda: gone.append("z"))  # another key's budget is its own
    assert (kept.held_bytes("a"), kept.held_bytes("b"), gone) == (300, 300, [])  # exactly at the limit
    kept.keep("a", "w", 1, lambda: gone.append("w"))  # one byte past: the oldest goes
    assert (kept.held_bytes("a"), gone) == (201, ["x"])
    kept.keep("a", "big", 1000, lambda: gone.append("big"))  # the newest always stays
    assert (kept.held_bytes("a"), gone) == (1000, ["x", "y", "w"])
    kept.drop("a", "big")
    assert kept.held_bytes("a") == 0 and kept.held_bytes("b") == 300


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    with bounded_worker(tiny_model_dir, tmp_path_factory.mktemp("answers"), Limits()) as running:
        yield running


class Actor:
    def __init__(self, url: str, key: str) -> None:
        self.control = httpx.Client(base_url=url + "/api/openapi/v1", timeout=60,
                                    headers={"X-API-Key": key, "Authorization": f"Bearer {key}"})
        self.url = url
        self.session = self.control.post("/service-sessions", json={"sdk_version": "raw"}).json()[
            "service_session_cuid"]

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.url + "/pytrio-actor/v1", timeout=60, headers={
            "Authorization": f"Bearer {token}", "Accept": "application/msgpack", "Content-Type": "application/msgpack"})


def event_id() -> str:
    return "event_" + "".join(secrets.choice("0123456789abcdefghjkmnpqrstvwxyz") for _ in range(12))


def test_event_answers_of_a_key_share_its_result_budget(worker):
    state = worker.app.state.pytrio.state
    actor = Actor(worker.url, KEY_A)
    created = actor.control.post(f"/service-sessions/{actor.session}/training-runs", json={
        "base_model": "tiny", "lora_rank": 2, "train_mlp": True, "train_attn": True, "train_unembed": True,
        "source_checkpoint_uri": "", "restore_optimizer": False, "seed": 1}).json()
    cuid = created["training_run_cuid"]
    index = iter(range(1, 100))
    with actor.client(created["actor_jwt"]["token"]) as http:
        def run(kind: str, payload: dict) -> tuple[str, dict]:
            eid = event_id()
            body = {"version": 1, "event_id": eid, "type": kind, "payload": payload, "metadata": {
                "index": next(index), "step": 0, "timestamp": 0, "sdk": "raw", "sdk_version": "0", "run_id": cuid}}
            answer = msgpack.unpackb(http.post("/events", content=msgpack.packb(body)).content, raw=False)
            while answer["status"] in ("accepted", "running"):
                answer = poll(eid)
            return eid, answer

        def poll(eid: str):
            got = http.get(f"/events/{eid}", headers={"Prefer": "wait=30"})
            return msgpack.unpackb(got.content, raw=False) if got.status_code == 200 else got.status_code

        lora = {"rank": 2, "seed": 1, "train_mlp": True, "train_attn": True, "train_unembed": True}
        first, answer = run("trainer.init_run", {"base_model": created["model_id"], "lora_config": lora})
        assert answer["status"] == "succeeded", answer
        datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": list(range(5, 45))}]},
                 "target_ids": list(range(6, 46))}
        forward = {"data": [datum] * 8, "loss": {"type": "cross_entropy"}, "gradient_accumulation": {
            "total_samples": 8, "total_active_tokens": 320, "total_advantage_tokens": 0}}
        ids = [run("trainer.forward", forward)[0] for _ in range(2)]
        tenant = tenant_id(KEY_A)
        held = state.answers.held_bytes(tenant)
        sizes = [len(state.training[cuid].events.get(e).answer) for e in [first, *ids]]
        assert held == sum(sizes) and sizes[1] > 1000  # every kept answer is counted
        state.answers.limit = sizes[1] + sizes[2]  # room for exactly the two forward answers
        third = run("trainer.forward", forward)[0]  # one past: the oldest go
        assert poll(first) == 404 and poll(ids[0]) == 404
        assert poll(ids[1])["status"] == "succeeded" and poll(third)["status"] == "succeeded"
        assert state.answers.held_bytes(tenant) <= state.answers.limit
        assert state.answers.held_bytes(tenant_id(KEY_B)) == 0
    state.answers.limit = Limits().max_result_bytes


def test_remembered_sample_answers_share_the_budget(worker):
    state = worker.app.state.pytrio.state
    actor = Actor(worker.url, KEY_B)
    created = actor.control.post(f"/service-sessions/{actor.session}/sampling-runs",
                                 json={"base_model": "tiny", "source_checkpoint_uri": ""}).json()
    cuid, token = created["sampling_run_cuid"], created["actor_jwt"]["token"]
    tenant = tenant_id(KEY_B)
    with httpx.Client(base_url=worker.url + "/pytrio-actor/v1", timeout=60,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        def sample(request_id: str) -> dict:
            got = http.post(f"/sampling-runs/{cuid}/sample", json={
                "request_id": request_id, "num_samples": 2,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 9, 14]}]},
                "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 3}})
            assert got.status_code == 200, got.text
            return got.json()

        before = state.answers.held_bytes(tenant)
        sample("r1")
        one = state.answers.held_bytes(tenant) - before
        assert one > 100 and "r1" in state.sampling[tenant][cuid].samples
        state.answers.limit = before + 2 * one + 64  # two such answers fit, a third does not
        sample("r2")
        assert "r1" in state.sampling[tenant][cuid].samples
        sample("r3")
        assert "r1" not in state.sampling[tenant][cuid].samples  # forgotten: a retry samples again
        assert state.answers.held_bytes(tenant) <= state.answers.limit
    state.answers.limit = Limits().max_result_bytes
