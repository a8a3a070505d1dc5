"""Two API keys are two tenants: over real HTTP, tenant B can neither see nor use anything of tenant A's
(training runs, samplers, requests, checkpoints, snapshots). Each attempt gets the same 404 as a name
that never existed, and A's things are untouched afterwards."""

from __future__ import annotations

import httpx
import pytest

import pytrio_compat as trio

from .reliability_helpers import KEY_A, KEY_B, datum, datum_wire


@pytest.fixture()
def tenant_a(special_worker, client_cache):
    client = trio.ServiceClient(base_url=special_worker.base_url, api_key=KEY_A)
    yield client
    client.close()


def http_for(worker, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=worker.base_url, headers=headers, timeout=30)


def fb_op(seq: int) -> dict:
    return {"seq_id": seq, "payload": {"op": "forward", "loss_fn": "cross_entropy", "data": [datum_wire()]}}


def test_another_tenant_gets_404_for_everything(special_worker, tenant_a):
    # tenant A's things, made through the SDK
    tc = tenant_a.create_lora_training_client("tiny", rank=4, seed=2)
    tc.forward_backward([datum()]).result()
    state = tc.save_state("a-state").result().path
    weights = tc.save_weights_for_sampler("a-weights").result().path
    snapshot_sampler = tc.save_weights_and_get_sampling_client()  # in-memory snapshot, trio:// path too
    snapshot = snapshot_sampler.model_path
    sampler = tenant_a.create_sampling_client(model_path=weights)
    with http_for(special_worker, KEY_A) as a:
        request_id = a.post(f"/v1/samplers/{sampler.sampler_id}/sample",
                            json={"prompt_tokens": [3, 4], "sampling_params": {"max_tokens": 2}}).json()["request_id"]
        a_listing = a.get("/v1/checkpoints").json()["checkpoints"]
        checkpoint_id = next(c["checkpoint_id"] for c in a_listing if c["path"] == state)
        a_run = a.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}},
                       headers={"Idempotency-Key": "same-key"}).json()["training_run_id"]

    run = tc.training_run_id
    attempts = [  # (method, path, json body or None, query params or None)
        ("GET", f"/v1/training_runs/{run}", None, None),
        ("DELETE", f"/v1/training_runs/{run}", None, None),
        ("POST", f"/v1/training_runs/{run}/ops", fb_op(tc._next_seq), None),
        ("POST", f"/v1/training_runs/{run}/ops", {"seq_id": tc._next_seq,
                                                  "payload": {"op": "save_state", "name": "stolen"}}, None),
        ("GET", f"/v1/requests/{request_id}", None, {"wait": 0}),
        ("GET", f"/v1/samplers/{sampler.sampler_id}", None, None),
        ("POST", f"/v1/samplers/{sampler.sampler_id}/sample",
         {"prompt_tokens": [3, 4], "sampling_params": {"max_tokens": 2}}, None),
        ("POST", "/v1/samplers", {"model_path": weights}, None),
        ("POST", "/v1/samplers", {"model_path": snapshot}, None),
        ("POST", "/v1/training_runs", {"from_checkpoint": state}, None),
        ("GET", "/v1/checkpoint_config", None, {"path": state}),
        ("GET", "/v1/checkpoint_config", None, {"path": weights}),
        ("DELETE", "/v1/checkpoints", None, {"path": state}),
        ("DELETE", "/v1/checkpoints", None, {"path": checkpoint_id}),
    ]

    def never_existed(path: str) -> str:
        return path.replace(run, "run-0123456789abcdef").replace(request_id, "req-" + "0" * 32).replace(
            sampler.sampler_id, "sampler-0123456789abcdef").replace(checkpoint_id, "0123456789abcdef")

    with http_for(special_worker, KEY_B) as b:
        b_run = b.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).json()["training_run_id"]
        attempts.append(("POST", f"/v1/training_runs/{b_run}/ops",
                         {"seq_id": 1, "payload": {"op": "load_state", "path": state}}, None))
        for method, path, body, params in attempts:
            response = b.request(method, path, json=body, params=params)
            assert response.status_code == 404, (method, path, response.text)
            ghost_params = {k: never_existed(str(v)) for k, v in (params or {}).items()} or None
            ghost_body = body
            if body and ("model_path" in body or "from_checkpoint" in body):  # a path that was never saved
                ghost_body = {k: v.replace(run, "run-0123456789abcdef") for k, v in body.items()}
            ghost = b.request(method, never_existed(path), json=ghost_body, params=ghost_params)
            assert ghost.status_code == 404 and ghost.json()["error"]["code"] == response.json()["error"]["code"], \
                (method, path, response.text, ghost.text)
        listing = b.get("/v1/checkpoints").json()["checkpoints"]
        assert all(c["path"] not in (state, weights) for c in listing)
        assert b.get("/v1/checkpoints", params={"training_run_id": run}).json()["checkpoints"] == []
        # the same Idempotency-Key from another tenant makes B's own run, never answers with A's
        b_idem = b.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}},
                        headers={"Idempotency-Key": "same-key"}).json()["training_run_id"]
        assert b_idem not in (a_run, run)
        for path in (f"/v1/training_runs/{b_run}", f"/v1/training_runs/{b_idem}"):
            b.delete(path)

    # and everything of A's still works for A
    with http_for(special_worker, KEY_A) as a:
        assert a.get(f"/v1/requests/{request_id}", params={"wait": 10}).json()["status"] == "succeeded"
        assert {c["path"] for c in a.get("/v1/checkpoints").json()["checkpoints"]} >= {state, weights}
        a.delete(f"/v1/training_runs/{a_run}")
    assert tc.forward([datum()]).result().metrics["token_count"] == 19.0
    assert tenant_a.create_training_client_from_state(state).get_info().base_model == "tiny"
    prompt = trio.ModelInput.from_ints([3, 4])
    for s in (sampler, snapshot_sampler, tenant_a.create_sampling_client(model_path=snapshot)):
        assert s.sample(prompt, sampling_params=trio.SamplingParams(max_tokens=2)).result().sequences


def test_keys_are_required_and_each_key_is_its_own_tenant(special_worker):
    tenants = set()
    for key in (KEY_A, KEY_B):
        with http_for(special_worker, key) as http:
            tenants.add(http.get("/v1/whoami").json()["tenant"])
    assert len(tenants) == 2
    with httpx.Client(base_url=special_worker.base_url, timeout=10) as http:
        assert http.get("/v1/whoami", headers={"X-API-Key": KEY_B}).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY_A}x"},
                        {"X-API-Key": KEY_A[:-1]}, {"Authorization": "Basic " + KEY_A}):
            for method, path in (("GET", "/v1/whoami"), ("GET", "/v1/checkpoints"), ("POST", "/v1/samplers"),
                                 ("GET", "/v1/requests/req-x"), ("GET", "/v1/capabilities")):
                response = http.request(method, path, headers=headers, json={} if method == "POST" else None)
                assert response.status_code == 401, (headers, path, response.text)
        assert http.get("/v1/health").status_code == 200  # liveness only: no data
