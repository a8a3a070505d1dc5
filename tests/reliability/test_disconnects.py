"""Clients that go away mid-request: the worker keeps serving and the work they started still completes."""

from __future__ import annotations

import json
import socket
import struct
import time

import httpx
import pytest

from .reliability_helpers import KEY_A, datum_wire

AUTH = {"Authorization": f"Bearer {KEY_A}"}


def raw_request(method: str, path: str, body: bytes = b"", declared_length: int | None = None) -> bytes:
    length = len(body) if declared_length is None else declared_length
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY_A}",
            "Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def send_and_vanish(port: int, data: bytes, hold: float = 0.0, reset: bool = False) -> None:
    """Send bytes, keep the connection for ``hold`` seconds without reading, then drop it (FIN or RST)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(data)
    time.sleep(hold)
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.fixture()
def http(special_worker):
    with httpx.Client(base_url=special_worker.base_url, headers=AUTH, timeout=60) as client:
        yield client


def new_run(http) -> str:
    response = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4, "seed": 3}})
    assert response.status_code == 200, response.text
    return response.json()["training_run_id"]


def slow_op(seq: int, delay: float) -> dict:
    return {"seq_id": seq, "payload": {"op": "forward_backward", "loss_fn": "cross_entropy",
                                       "loss_fn_config": {"fault_injection": {"delay_seconds": delay}},
                                       "data": [datum_wire()]}}


def test_long_poll_clients_that_vanish_do_not_stop_the_request(special_worker, http):
    run = new_run(http)
    accepted = http.post(f"/v1/training_runs/{run}/ops", json=slow_op(1, 1.5)).json()
    rid = accepted["request_id"]
    poll = raw_request("GET", f"/v1/requests/{rid}?wait=30")
    for i in range(6):  # long polls that go away mid-wait, half of them with a TCP reset
        send_and_vanish(special_worker.port, poll, hold=0.05, reset=bool(i % 2))
    with pytest.raises(httpx.ReadTimeout):  # a client with a short timeout gives up on its long poll
        httpx.get(f"{special_worker.base_url}/v1/requests/{rid}", params={"wait": 30}, headers=AUTH, timeout=0.2)
    started = time.monotonic()
    assert http.get("/v1/health").json()["status"] == "ok"  # the HTTP side is not blocked by the busy model
    assert time.monotonic() - started < 1.0
    status = http.get(f"/v1/requests/{rid}", params={"wait": 30}).json()
    assert status["status"] == "succeeded", status
    assert status["kind"] == "forward_backward" and status["run_seconds"] >= 1.5


def test_a_training_post_whose_client_vanishes_still_runs_once(special_worker, http):
    run = new_run(http)
    body = json.dumps(slow_op(1, 0.3)).encode()
    send_and_vanish(special_worker.port, raw_request("POST", f"/v1/training_runs/{run}/ops", body), reset=True)
    time.sleep(0.3)
    # the client comes back and resends the same seq_id: the worker answers with the request it already took
    again = http.post(f"/v1/training_runs/{run}/ops", content=body, headers={"Content-Type": "application/json"})
    assert again.status_code == 200, again.text
    assert again.json()["duplicate"] is True
    status = http.get(f"/v1/requests/{again.json()['request_id']}", params={"wait": 30}).json()
    assert status["status"] == "succeeded", status
    assert http.get(f"/v1/training_runs/{run}").json()["last_seq_id"] == 1


def test_a_body_cut_off_midway_queues_nothing(special_worker, http):
    run = new_run(http)
    body = json.dumps(slow_op(1, 0.0)).encode()
    send_and_vanish(special_worker.port, raw_request("POST", f"/v1/training_runs/{run}/ops", body[:50],
                                                     declared_length=len(body)), hold=0.1)
    time.sleep(0.2)
    assert http.get(f"/v1/training_runs/{run}").json()["last_seq_id"] == 0
    ok = http.post(f"/v1/training_runs/{run}/ops", content=body, headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and ok.json()["duplicate"] is False


def test_a_sample_post_whose_client_vanishes_does_not_disturb_others(special_worker, http):
    sampler = http.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
    request = {"prompt_tokens": [5, 6, 7], "num_samples": 2, "sampling_params": {"max_tokens": 24, "seed": 11}}
    body = json.dumps(request).encode()
    for reset in (False, True):
        send_and_vanish(special_worker.port, raw_request("POST", f"/v1/samplers/{sampler}/sample", body), reset=reset)
    first = http.post(f"/v1/samplers/{sampler}/sample", json=request).json()["request_id"]
    result = http.get(f"/v1/requests/{first}", params={"wait": 30}).json()
    assert result["status"] == "succeeded"
    again = http.post(f"/v1/samplers/{sampler}/sample", json=request).json()["request_id"]
    repeated = http.get(f"/v1/requests/{again}", params={"wait": 30}).json()["result"]["sequences"]
    # same seed, same tokens: nothing leaked in from the vanished requests (which may have been decoded
    # in one batch with the first, so logprobs agree to float precision rather than bit for bit)
    assert [s["tokens"] for s in repeated] == [s["tokens"] for s in result["result"]["sequences"]]
    for a, b in zip(repeated, result["result"]["sequences"]):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    log = (special_worker.storage.parent / "worker.log").read_text()
    assert "unhandled error" not in log
