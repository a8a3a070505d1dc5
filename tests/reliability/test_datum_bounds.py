"""Datums per forward/backward request are bounded on every protocol (``--max-datums-per-request``): native ops,
Tinker forward_backward (protobuf), PyTRIO Actor events (counted before a datum is parsed). Each at the limit and
one past; the refusal names the field and the flag. One in-process worker with the limit at 4."""

from __future__ import annotations

import secrets
from dataclasses import replace

import httpx
import msgpack
import pytest

from server_mock.config import Limits

from .bounded_worker import bounded_worker
from .reliability_helpers import KEY_A, datum_wire

LIMIT = 4
FLAG = "--max-datums-per-request"


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    with bounded_worker(tiny_model_dir, tmp_path_factory.mktemp("datums"),
                        replace(Limits(), max_datums_per_request=LIMIT)) as running:
        yield running


def test_native_ops_at_the_limit_and_one_past(worker):
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=worker.url, headers=headers, timeout=60) as http:
        run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2}}).json()
        ops = f"/v1/training_runs/{run['training_run_id']}/ops"
        over = http.post(ops, json={"seq_id": 1, "payload": {"op": "forward", "data": [datum_wire(i) for i in
                                                                                        range(LIMIT + 1)]}})
        assert over.status_code == 413, over.text
        error = over.json()["error"]
        assert error["code"] == "too_many_datums" and error["field"] == "data"
        assert f"{LIMIT + 1} datums" in error["message"] and f"max_datums_per_request={LIMIT}" in error["message"]
        assert FLAG in error["message"]
        at = http.post(ops, json={"seq_id": 1, "payload": {"op": "forward",
                                                           "data": [datum_wire(i) for i in range(LIMIT)]}})
        assert at.status_code in (200, 202), at.text
        done = http.get(f"/v1/requests/{at.json()['request_id']}", params={"wait": 30}).json()
        assert done["status"] == "succeeded", done
        assert len(done["result"]["loss_fn_outputs"]) == LIMIT


def test_tinker_forward_backward_at_the_limit_and_one_past(worker):
    pytest.importorskip("tinker")
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker_raw_client import RawTinker, datum

    raw = RawTinker(worker.url, KEY_A)
    try:
        model_id = raw.model("tiny", rank=2)

        def send(count: int, seq_id: int):
            request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
                data=[datum([5 + i, 9, 14, 20]) for i in range(count)], loss_fn="cross_entropy"),
                model_id=model_id, seq_id=seq_id)
            return raw.forward_backward(model_id, seq_id, body=forward_backward_request_to_proto(request)
                                        .SerializeToString())

        over = send(LIMIT + 1, 1)
        assert over.status_code == 413, over.text
        assert over.json()["field"] == "data" and f"{LIMIT + 1} datums" in over.json()["detail"]
        assert f"max_datums_per_request={LIMIT}" in over.json()["detail"] and FLAG in over.json()["detail"]
        at = send(LIMIT, 2)  # the refused one used up its seq_id
        assert at.status_code == 200, at.text
        assert isinstance(raw.result(at.json()["request_id"]), bytes)  # a ForwardBackwardOutput
    finally:
        raw.close()


def test_pytrio_events_at_the_limit_and_one_past_and_the_sdk_is_told(worker):
    control = httpx.Client(base_url=worker.url + "/api/openapi/v1", timeout=60,
                           headers={"X-API-Key": KEY_A, "Authorization": f"Bearer {KEY_A}"})
    with control:
        session = control.post("/service-sessions", json={"sdk_version": "raw"}).json()["service_session_cuid"]
        created = control.post(f"/service-sessions/{session}/training-runs", json={
            "base_model": "tiny", "lora_rank": 2, "train_mlp": True, "train_attn": True, "train_unembed": True,
            "source_checkpoint_uri": "", "restore_optimizer": False, "seed": 1}).json()
        assert created["trainer"]["max_batch_size"] == LIMIT  # the SDK splits its calls into events this size
    cuid, token = created["training_run_cuid"], created["actor_jwt"]["token"]
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/msgpack",
               "Content-Type": "application/msgpack"}
    with httpx.Client(base_url=worker.url + "/pytrio-actor/v1", headers=headers, timeout=60) as actor:
        index = iter(range(1, 100))

        def run(kind: str, payload: dict) -> dict:
            eid = "event_" + "".join(secrets.choice("0123456789abcdefghjkmnpqrstvwxyz") for _ in range(12))
            body = {"version": 1, "event_id": eid, "type": kind, "payload": payload,
                    "metadata": {"index": next(index), "step": 0, "timestamp": 0, "sdk": "raw", "sdk_version": "0",
                                 "run_id": cuid}}
            sent = actor.post("/events", content=msgpack.packb(body, use_bin_type=True))
            assert sent.status_code == 200, sent.text
            answer = msgpack.unpackb(sent.content, raw=False)
            while answer["status"] in ("accepted", "running"):
                polled = actor.get(f"/events/{eid}", headers={"Prefer": "wait=30"})
                answer = msgpack.unpackb(polled.content, raw=False)
            return answer

        lora = {"rank": 2, "seed": 1, "train_mlp": True, "train_attn": True, "train_unembed": True}
        assert run("trainer.init_run", {"base_model": created.get("model_id", "tiny"),
                                        "lora_config": lora})["status"] == "succeeded"

        def forward(count: int) -> dict:
            datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 9, 14]}]},
                     "target_ids": [9, 14, 20]}
            return run("trainer.forward", {"data": [datum] * count, "loss": {"type": "cross_entropy"},
                                           "gradient_accumulation": {"total_samples": count,
                                                                     "total_active_tokens": 3 * count,
                                                                     "total_advantage_tokens": 0}})

        over = forward(LIMIT + 1)
        assert over["status"] == "failed", over
        message = str(over)
        assert "too_many_datums" in message and "payload.data" in message and FLAG in message
        assert forward(LIMIT)["status"] == "succeeded"
