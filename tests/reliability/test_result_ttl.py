"""A client that never polls: finished results are dropped after --result-ttl seconds, with a clear 404."""

from __future__ import annotations

import time

import httpx
import pytest

import pytrio_compat as trio
from pytrio_compat.errors import RequestLostError
from server_mock.engine.jobs import Job
from server_mock.engine.requests import RequestStore


@pytest.fixture(scope="module")
def short_ttl_worker(worker_factory):
    return worker_factory("--result-ttl", "1")


def submit_sample(http: httpx.Client) -> str:
    sampler = http.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
    body = {"prompt_tokens": [4, 5, 6], "sampling_params": {"max_tokens": 4, "seed": 1}}
    return http.post(f"/v1/samplers/{sampler}/sample", json=body).json()["request_id"]


def test_unpolled_and_polled_results_expire_after_the_ttl(short_ttl_worker, client_cache):
    client = trio.ServiceClient(base_url=short_ttl_worker.base_url)
    try:
        with httpx.Client(base_url=short_ttl_worker.base_url, timeout=30) as http:
            never_polled = submit_sample(http)
            polled = submit_sample(http)
            assert http.get(f"/v1/requests/{polled}", params={"wait": 10}).json()["status"] == "succeeded"
            time.sleep(2.2)  # TTL 1 s; the sweep runs every TTL/2
            for rid in (never_polled, polled):
                response = http.get(f"/v1/requests/{rid}")
                assert response.status_code == 404, response.text
                assert "expired or worker restarted" in response.json()["error"]["message"]
            assert http.get("/v1/health").json()["status"] == "ok"
        # the SDK reports it as lost, at once (a 404 is final: no retrying)
        started = time.monotonic()
        with pytest.raises(RequestLostError) as err:
            client._runtime.run(client._runtime.wait_for_request(never_polled, "sample"))
        assert never_polled in str(err.value) and "expired" in str(err.value)
        assert time.monotonic() - started < 5
    finally:
        client.close()


def test_the_sweep_forgets_finished_requests_only():
    store = RequestStore(result_ttl=0.05)
    finished = Job("req-done", "sample", dict, finished=time.monotonic() - 1)
    running = Job("req-running", "sample", dict, status="running")
    store._jobs.update({finished.request_id: finished, running.request_id: running})
    assert store.sweep() == 1
    assert store.get("req-done") is None and store.get("req-running") is running
