"""Explicit limits: exceeding one is answered 413/429 naming it (429 with Retry-After), and the client backs
off and retries a 429 until the limit frees up, without failing the call."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

import pytrio_compat as trio

from .reliability_helpers import KEY_A, KEY_B, datum, datum_wire

LIMITS = ["--max-body-bytes", "4000", "--max-tokens-per-request", "64", "--max-num-samples", "2",
          "--max-training-runs", "2", "--max-adapters", "3", "--max-queued-requests", "2"]


@pytest.fixture(scope="module")
def limited_worker(worker_factory):
    # fault injection for slow requests that keep the queue busy
    return worker_factory(*LIMITS, api_keys=[KEY_A, KEY_B], env={"PYTRIO_WORKER_FAULT_INJECTION": "1"})


@pytest.fixture()
def http_a(limited_worker):
    with httpx.Client(base_url=limited_worker.base_url, headers={"Authorization": f"Bearer {KEY_A}"},
                      timeout=30) as client:
        yield client


@pytest.fixture()
def http_b(limited_worker):
    with httpx.Client(base_url=limited_worker.base_url, headers={"Authorization": f"Bearer {KEY_B}"},
                      timeout=30) as client:
        yield client


@pytest.fixture(autouse=True)
def no_runs_left_behind(http_a, http_b):
    yield
    for http, key in ((http_a, KEY_A), (http_b, KEY_B)):
        for run in list(created_runs.get(key, [])):
            http.delete(f"/v1/training_runs/{run}")
        created_runs[key] = []


created_runs: dict[str, list[str]] = {}


def create_run(http) -> httpx.Response:
    response = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4, "seed": 1}})
    if response.status_code == 200:
        key = http.headers["Authorization"].split()[-1]
        created_runs.setdefault(key, []).append(response.json()["training_run_id"])
    return response


def assert_limit(response: httpx.Response, status: int, limit: str) -> None:
    assert response.status_code == status, response.text
    assert limit in response.json()["error"]["message"], response.text
    if status == 429:
        assert float(response.headers["Retry-After"]) > 0


def op(seq: int, data: list[dict], config: dict | None = None) -> dict:
    return {"seq_id": seq, "payload": {"op": "forward_backward", "loss_fn": "cross_entropy",
                                       "loss_fn_config": config or {}, "data": data}}


def test_each_limit_is_named_when_exceeded(http_a, http_b):
    run = create_run(http_a).json()["training_run_id"]
    url = f"/v1/training_runs/{run}/ops"
    big = json.dumps(op(1, [datum_wire()] * 30))
    assert len(big) > 4000
    assert_limit(http_a.post(url, content=big, headers={"Content-Type": "application/json"}), 413, "max_body_bytes")
    assert_limit(http_a.post(url, json=op(1, [datum_wire(i, n=25) for i in range(3)])), 413,
                 "max_tokens_per_request")
    sampler = http_a.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
    sample = {"prompt_tokens": [1, 2], "num_samples": 3, "sampling_params": {"max_tokens": 2}}
    assert_limit(http_a.post(f"/v1/samplers/{sampler}/sample", json=sample), 413, "max_num_samples")

    # per-tenant runs, then all tenants together
    assert create_run(http_a).status_code == 200
    assert_limit(create_run(http_a), 429, "max_training_runs")
    assert create_run(http_b).status_code == 200
    assert_limit(create_run(http_b), 429, "max_adapters")

    # requests queued or running, per tenant
    slow = {"fault_injection": {"delay_seconds": 0.5}}
    first = http_a.post(url, json=op(1, [datum_wire()], slow)).json()["request_id"]
    assert http_a.post(url, json=op(2, [datum_wire()], slow)).status_code == 200
    assert_limit(http_a.post(url, json=op(3, [datum_wire()])), 429, "max_queued_requests")
    assert_limit(http_a.post(f"/v1/samplers/{sampler}/sample", json={**sample, "num_samples": 1}), 429,
                 "max_queued_requests")
    other = http_b.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
    assert http_b.post(f"/v1/samplers/{other}/sample", json={**sample, "num_samples": 1}).status_code == 200
    assert http_a.get(f"/v1/requests/{first}", params={"wait": 10}).json()["status"] == "succeeded"
    assert http_a.post(url, json=op(3, [datum_wire()])).status_code == 200  # the seq_id was not used up


def test_the_token_limit_holds_at_exactly_its_value(http_a):
    """64 tokens (the limit) are accepted, 65 are not."""
    run = create_run(http_a).json()["training_run_id"]
    url = f"/v1/training_runs/{run}/ops"
    over = http_a.post(url, json=op(1, [datum_wire(0, n=33), datum_wire(1, n=34)]))  # 32 + 33 tokens
    assert_limit(over, 413, "max_tokens_per_request=64")
    assert "65 tokens" in over.text, over.text
    at_limit = http_a.post(url, json=op(1, [datum_wire(0, n=33), datum_wire(1, n=33)]))  # 32 + 32 tokens
    assert at_limit.status_code == 200, at_limit.text
    status = http_a.get(f"/v1/requests/{at_limit.json()['request_id']}", params={"wait": 30}).json()
    assert status["status"] == "succeeded" and status["result"]["metrics"]["token_count"] == 64.0, status


def test_the_client_waits_out_a_busy_queue(limited_worker, fast_retries, client_cache, caplog):
    client = trio.ServiceClient(base_url=limited_worker.base_url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=1)
        created_runs.setdefault(KEY_A, []).append(tc.training_run_id)
        slow = [tc.forward_backward([datum(i)], loss_fn_config={"fault_injection": {"delay_seconds": 0.6}})
                for i in range(2)]
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="pytrio_compat"):
            logging.getLogger("pytrio_compat").addHandler(caplog.handler)
            try:
                step = tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=60)  # 429 until one ends
            finally:
                logging.getLogger("pytrio_compat").removeHandler(caplog.handler)
        assert time.monotonic() - started >= 0.5
        assert step.metrics["step"] == 1.0
        for future in slow:
            future.result()
        assert any("max_queued_requests=2" in r.getMessage() and "waiting" in r.getMessage() for r in caplog.records)
    finally:
        client.close()


def test_the_client_waits_until_a_training_run_slot_frees_up(limited_worker, fast_retries, client_cache, http_a):
    client = trio.ServiceClient(base_url=limited_worker.base_url, api_key=KEY_A)
    try:
        runs = [client.create_lora_training_client("tiny", rank=4, seed=i) for i in range(2)]
        created_runs.setdefault(KEY_A, []).extend(tc.training_run_id for tc in runs)
        timer = threading.Timer(1.0, lambda: http_a.delete(f"/v1/training_runs/{runs[0].training_run_id}"))
        timer.start()
        started = time.monotonic()
        third = client.create_lora_training_client("tiny", rank=4, seed=3)  # 429 (max_training_runs) at first
        created_runs[KEY_A].append(third.training_run_id)
        assert time.monotonic() - started >= 0.9
        assert third.forward_backward([datum()]).result().metrics["token_count"] == 19.0
        timer.join()
    finally:
        client.close()


class TooManyRequestsTwice(httpx.AsyncBaseTransport):
    """Answers the first two sample POSTs with 429 + Retry-After, as a busy worker or proxy would."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.refused = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/sample") and self.refused < 2:
            self.refused += 1
            body = {"error": {"code": "busy", "message": "limit max_queued_requests=1 reached"}}
            return httpx.Response(429, json=body, headers={"Retry-After": "0.3"})
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_retry_after_is_honoured(limited_worker, fast_retries, client_cache):
    transport = TooManyRequestsTwice()
    client = trio.ServiceClient(base_url=limited_worker.base_url, api_key=KEY_A, _transport=transport)
    try:
        sampler = client.create_sampling_client(base_model="tiny")
        started = time.monotonic()
        result = sampler.sample(trio.ModelInput.from_ints([3, 4]),
                                sampling_params=trio.SamplingParams(max_tokens=2, seed=0)).result(timeout=30)
        assert transport.refused == 2 and len(result.sequences) == 1
        assert time.monotonic() - started >= 0.6  # two waits of Retry-After, not the 0.05 s backoff
    finally:
        client.close()


def test_deleting_every_run_leaves_base_model_sampling_working(http_a):
    run = create_run(http_a).json()["training_run_id"]
    done = http_a.post(f"/v1/training_runs/{run}/ops", json=op(1, [datum_wire()])).json()["request_id"]
    assert http_a.get(f"/v1/requests/{done}", params={"wait": 10}).json()["status"] == "succeeded"
    assert http_a.delete(f"/v1/training_runs/{run}").status_code == 200
    created_runs[KEY_A].remove(run)
    sampler = http_a.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
    rid = http_a.post(f"/v1/samplers/{sampler}/sample",
                      json={"prompt_tokens": [3, 4], "sampling_params": {"max_tokens": 2}}).json()["request_id"]
    status = http_a.get(f"/v1/requests/{rid}", params={"wait": 10}).json()
    assert status["status"] == "succeeded", status
