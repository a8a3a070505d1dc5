"""Malformed requests sent straight to the worker over HTTP: each gets a 4xx naming the field, the worker
stays healthy, and the adapter (weights, Adam state and pending gradients) stays bit-identical."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytrio_compat as trio
from pytrio_compat.types.tensor import WireTensor

VOCAB = 512


def wt(values, dtype="int64") -> dict:
    return WireTensor.from_array(np.asarray(values, dtype=np.int64 if dtype == "int64" else np.float32)).model_dump()


def datum(n=6, **overrides) -> dict:
    inputs = {"target_tokens": wt(range(20, 20 + n)), "logprobs": wt([-1.0] * n, "float32"),
              "advantages": wt([0.5] * n, "float32")}
    inputs.update(overrides.pop("inputs", {}))
    body = {"tokens": wt(range(10, 10 + n)), "loss_fn_inputs": inputs}
    body.update(overrides)
    return body


def fb(data=None, loss_fn="importance_sampling", config=None) -> dict:
    return {"op": "forward_backward", "loss_fn": loss_fn, "loss_fn_config": config or {},
            "data": [datum()] if data is None else data}


def nan_tensor() -> dict:
    return wt([-1.0, float("nan"), -1.0, -1.0, -1.0, -1.0], "float32")


OP_CASES = [
    ("unknown loss", fb(loss_fn="reinforce++"), 400, "loss_fn"),
    ("missing target_tokens", fb([datum(inputs={"target_tokens": None})]), 422, "target_tokens"),
    ("missing advantages", fb([{"tokens": wt(range(6)), "loss_fn_inputs": {"target_tokens": wt(range(6)),
                                                                          "logprobs": wt([0.0] * 6, "float32")}}]),
     400, "advantages"),
    ("short logprobs", fb([datum(inputs={"logprobs": wt([-1.0] * 5, "float32")})]), 400, "logprobs"),
    ("long targets", fb([datum(inputs={"target_tokens": wt(range(7))})]), 400, "target_tokens"),
    ("token id >= vocab", fb([datum(tokens=wt([1, 2, VOCAB, 3, 4, 5]))]), 400, "tokens"),
    ("negative token id", fb([datum(tokens=wt([1, 2, -5, 3, 4, 5]))]), 400, "tokens"),
    ("target >= vocab", fb([datum(inputs={"target_tokens": wt([1, 2, 3, 4, 5, 10**6])})]), 400, "target_tokens"),
    ("NaN logprobs", fb([datum(inputs={"logprobs": nan_tensor()})]), 400, "logprobs"),
    ("inf advantages", fb([datum(inputs={"advantages": wt([np.inf] + [0.1] * 5, "float32")})]), 400, "advantages"),
    ("-inf weights", fb([{"tokens": wt(range(6)), "loss_fn_inputs": {
        "target_tokens": wt(range(6)), "weights": wt([-np.inf] + [1.0] * 5, "float32")}}], "cross_entropy"),
     400, "weights"),
    ("empty batch", fb([]), 400, "data"),
    ("empty datum", fb([datum(n=0)]), 400, "tokens"),
    ("float tokens", fb([datum(tokens=wt([1.0] * 6, "float32"))]), 400, "tokens"),
    ("float targets", fb([datum(inputs={"target_tokens": wt([1.0] * 6, "float32")})]), 400, "target_tokens"),
    ("bad base64", fb([datum(tokens={"dtype": "int64", "shape": [6], "b64": "%%%not-base64"})]), 400, "tokens"),
    ("bytes/shape mismatch", fb([datum(tokens={"dtype": "int64", "shape": [6], "b64": base64.b64encode(
        b"\0" * 8).decode()})]), 400, "tokens"),
    ("2-D tokens", fb([datum(tokens=WireTensor.from_array(np.zeros((2, 3), np.int64)).model_dump())]), 400, "tokens"),
    ("unknown dtype", fb([datum(tokens={"dtype": "int8", "shape": [6], "b64": ""})]), 422, "dtype"),
    ("unknown config key", fb(config={"clip_epsilon": 0.2}, loss_fn="ppo"), 400, "loss_fn_config.clip_epsilon"),
    ("ppo low > high", fb(config={"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, loss_fn="ppo"),
     400, "clip"),
    ("config not numeric", fb(config={"beta": "lots"}, loss_fn="dro"), 400, "beta"),
    # stable_reinforce reads the worker's sampling records, which only the Tinker protocol links to a datum
    ("client-sent sampling records", fb([datum(inputs={"recorded_logprobs": wt([-1.0] * 6, "float32"),
                                                      "recorded_mask": wt([1.0] * 6, "float32")})],
                                        loss_fn="stable_reinforce"), 400, "recorded_logprobs"),
    ("negative kl_coef", fb(config={"kl_coef": -0.1}, loss_fn="ppo"), 400, "loss_fn_config.kl_coef"),
    ("unknown kl_estimator", fb(config={"kl_coef": 0.1, "kl_estimator": "k9"}), 400, "loss_fn_config.kl_estimator"),
    ("kl on cross_entropy", fb([{"tokens": wt(range(6)), "loss_fn_inputs": {"target_tokens": wt(range(6))}}],
                               "cross_entropy", {"kl_coef": 0.1}), 400, "loss_fn_config.kl_coef"),
    ("return_entropy 2", fb(config={"return_entropy": 2}), 400, "loss_fn_config.return_entropy"),
    ("NaN policy weights", fb([datum(inputs={"weights": nan_tensor()})]), 400, "weights"),
    ("negative learning rate", {"op": "optim_step", "adam_params": {"learning_rate": -1e-3}}, 400, "learning_rate"),
    ("beta1 = 1", {"op": "optim_step", "adam_params": {"beta1": 1.0}}, 400, "beta1"),
    ("eps = 0", {"op": "optim_step", "adam_params": {"eps": 0.0}}, 400, "eps"),
    ("unknown adam field", {"op": "optim_step", "adam_params": {"momentum": 0.9}}, 422, "momentum"),
    ("string learning rate", {"op": "optim_step", "adam_params": {"learning_rate": "fast"}}, 422, "learning_rate"),
    ("traversal in save name", {"op": "save_state", "name": "../../etc/evil"}, 400, "name"),
    ("absolute save name", {"op": "save_weights_for_sampler", "name": "/tmp/x"}, 400, "name"),
    ("negative ttl", {"op": "save_state", "name": "ok", "ttl_seconds": -5}, 400, "ttl_seconds"),
    ("load with ../", {"op": "load_state", "path": "trio://../storage/state/x"}, 400, "path"),
    ("load absolute path", {"op": "load_state", "path": "/etc/passwd"}, 400, "path"),
    ("load pickle path", {"op": "load_state", "path": "file:///tmp/model.bin"}, 400, "path"),
    ("load missing checkpoint", {"op": "load_state", "path": "trio://run-0000/state/nothing"}, 404, "path"),
    ("unknown op", {"op": "train_everything"}, 422, "payload"),
]


@pytest.fixture()
def victim(service, worker):
    """A run with pending gradients, and an identical control run that sees no bad requests."""
    runs = []
    for _ in range(2):
        tc = service.create_lora_training_client("tiny", rank=4, seed=21)
        ids = list(range(30, 50))
        d = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
        tc.forward_backward([d]).result()
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
        tc.forward_backward([d]).result()  # gradients pending
        runs.append(tc)
    return runs


def final_weights(worker, tc) -> dict[str, bytes]:
    from server_mock.storage.checkpoints import CheckpointStore, parse_path

    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("fingerprint", overwrite=True).result().path
    return CheckpointStore(worker.storage).fingerprint(parse_path(path))


def test_malformed_requests_are_rejected_and_change_nothing(worker, service, victim):
    tc, control = victim
    headers = {"Content-Type": "application/json"}
    url = f"{worker.base_url}/v1/training_runs/{tc.training_run_id}/ops"
    seq = tc._next_seq
    with httpx.Client(timeout=30) as http:
        for label, payload, status, field in OP_CASES:
            response = http.post(url, content=json.dumps({"seq_id": seq, "payload": payload}), headers=headers)
            assert response.status_code == status, (label, response.text)
            error = response.json()["error"]
            assert field in error["message"] or field in (error.get("field") or ""), (label, error)
        raw_cases = [
            ("seq out of order", json.dumps({"seq_id": seq + 5, "payload": fb()}), 409, "seq_id"),
            ("seq one past the next", json.dumps({"seq_id": seq + 1, "payload": fb()}), 409, "seq_id"),
            ("seq zero", json.dumps({"seq_id": 0, "payload": fb()}), 422, "seq_id"),
            ("not JSON", "{seq_id: 1,", 400, "body"),
            ("bad UTF-8", b'{"seq_id": 1, "payload": "\xff\xfe"}', 400, "body"),
            ("payload missing", json.dumps({"seq_id": seq}), 422, "payload"),
            ("list body", "[1, 2, 3]", 422, "body"),
        ]
        for label, content, status, field in raw_cases:
            response = http.post(url, content=content, headers=headers)
            assert response.status_code == status, (label, response.text)
            assert field in response.text, (label, response.text)
        good_op = json.dumps({"seq_id": seq, "payload": {"op": "optim_step", "adam_params": {"learning_rate": 1.0}}})
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/jsonx", "json", None):
            response = http.post(url, content=good_op, headers={"Content-Type": ctype} if ctype else {})
            assert response.status_code == 415, (ctype, response.text)
            assert response.json()["error"]["field"] == "Content-Type", response.text
        assert http.post(f"{worker.base_url}/v1/training_runs/run-nope/ops", json={"seq_id": 1, "payload": fb()}
                         ).status_code == 404
        assert http.get(f"{worker.base_url}/v1/health").json()["status"] == "ok"
    assert final_weights(worker, tc) == final_weights(worker, control)


SAMPLE_CASES = [
    ("num_samples 0", {"num_samples": 0}, 400, "num_samples"),
    ("num_samples 10^6", {"num_samples": 10**6}, 413, "num_samples"),
    ("max_tokens 0", {"sampling_params": {"max_tokens": 0}}, 400, "max_tokens"),
    ("max_tokens negative", {"sampling_params": {"max_tokens": -3}}, 400, "max_tokens"),
    ("max_tokens huge", {"sampling_params": {"max_tokens": 10**9}}, 413, "max_tokens"),
    ("empty prompt", {"prompt_tokens": []}, 400, "prompt_tokens"),
    ("prompt id out of vocab", {"prompt_tokens": [1, VOCAB + 3]}, 400, "prompt_tokens"),
    ("negative temperature", {"sampling_params": {"max_tokens": 4, "temperature": -1}}, 400, "temperature"),
    ("top_p zero", {"sampling_params": {"max_tokens": 4, "top_p": 0}}, 400, "top_p"),
    ("top_k -5", {"sampling_params": {"max_tokens": 4, "top_k": -5}}, 400, "top_k"),
    ("stop id out of vocab", {"sampling_params": {"max_tokens": 4, "stop_token_ids": [VOCAB]}}, 400, "stop_token_ids"),
    ("empty stop string", {"sampling_params": {"max_tokens": 4, "stop": [""]}}, 400, "stop"),
    ("topk prompt logprobs 500", {"topk_prompt_logprobs": 500}, 400, "topk_prompt_logprobs"),
    ("missing sampling_params", {"sampling_params": None}, 422, "sampling_params"),
    ("prompt as string", {"prompt_tokens": "hello"}, 422, "prompt_tokens"),
    ("17 stop strings", {"sampling_params": {"max_tokens": 4, "stop": ["x"] * 17}}, 413, "max_stop_strings=16"),
    ("257-byte stop string", {"sampling_params": {"max_tokens": 4, "stop": ["a" * 257]}}, 413,
     "max_stop_string_bytes=256"),
    ("86 euro signs (258 bytes)", {"sampling_params": {"max_tokens": 4, "stop": ["ok", "\u20ac" * 86]}}, 413,
     "stop[1]"),
    ("1025 stop token ids", {"sampling_params": {"max_tokens": 4, "stop_token_ids": [1] * 1025}}, 413,
     "max_stop_token_ids=1024"),
    ("stop not a list", {"sampling_params": {"max_tokens": 4, "stop": 5}}, 422, "stop"),
]


def test_malformed_sampling_and_creation_requests(worker, service):
    sampler = service.create_sampling_client(base_model="tiny")
    url = f"{worker.base_url}/v1/samplers/{sampler.sampler_id}/sample"
    good = {"prompt_tokens": [5, 6, 7], "num_samples": 1, "sampling_params": {"max_tokens": 4}}
    with httpx.Client(timeout=30) as http:
        for label, change, status, field in SAMPLE_CASES:
            body = {**good, **change}
            if "sampling_params" in change and change["sampling_params"] is not None:
                body["sampling_params"] = {**good["sampling_params"], **change["sampling_params"]}
            body = {k: v for k, v in body.items() if v is not None}
            response = http.post(url, json=body)
            assert response.status_code == status, (label, response.text)
            assert field in response.text, (label, response.text)
        create_cases = [
            ("/v1/training_runs", {"base_model": "tiny", "lora": {"rank": 0}}, 400, "rank"),
            ("/v1/training_runs", {"base_model": "tiny", "lora": {"rank": 100000}}, 400, "rank"),
            ("/v1/training_runs", {"base_model": "no-such-model"}, 404, "base_model"),
            ("/v1/training_runs", {"base_model": "tiny", "lora": {"train_mlp": False, "train_attn": False,
                                                                  "train_unembed": False}}, 400, "lora"),
            ("/v1/training_runs", {"from_checkpoint": "../../secret"}, 400, "from_checkpoint"),
            ("/v1/samplers", {"model_path": "/home/user/adapter"}, 400, "model_path"),
            ("/v1/samplers", {"model_path": "trio://run-x/sampler/../../etc"}, 400, "model_path"),
            ("/v1/samplers", {"base_model": "nope"}, 404, "base_model"),
            ("/v1/samplers", {}, 400, "base_model"),
        ]
        for path, body, status, field in create_cases:
            response = http.post(worker.base_url + path, json=body)
            assert response.status_code == status, (path, body, response.text)
            assert field in response.text, (path, body, response.text)
        assert http.post(f"{worker.base_url}/v1/samplers/sampler-nope/sample", json=good).status_code == 404
        assert http.get(f"{worker.base_url}/v1/requests/req-nope").status_code == 404
        ok = http.post(url, json=good)
        assert ok.status_code == 200
        at_limits = {**good, "sampling_params": {"max_tokens": 4, "stop": ["\u20ac" * 85 + "a"] * 16,
                                                 "stop_token_ids": list(range(VOCAB)) * 2}}
        assert http.post(url, json=at_limits).status_code == 200  # exactly at every limit is fine
        poll = f"{worker.base_url}/v1/requests/{ok.json()['request_id']}"
        for wait in ("nan", "NaN", "inf", "-inf", "1e400", "-1", "-0.5", "soon", ""):
            response = http.get(poll, params={"wait": wait})
            assert response.status_code == 400, (wait, response.text)
            assert response.json()["error"]["field"] == "wait", response.text
        assert http.get(poll, params={"wait": "1e9"}).json()["status"] == "succeeded"  # long waits are cut to 60 s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.lists(st.integers(-2**40, 2**40), min_size=0, max_size=12),
    targets=st.lists(st.integers(-200, 1000), min_size=0, max_size=12),
    floats=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=12),
    loss_fn=st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "bogus"]),
)
def test_fuzzed_datums_never_crash_the_worker(worker, service, tokens, targets, floats, loss_fn):
    run = service.create_lora_training_client("tiny", rank=4, seed=0) if not hasattr(
        test_fuzzed_datums_never_crash_the_worker, "run") else test_fuzzed_datums_never_crash_the_worker.run
    test_fuzzed_datums_never_crash_the_worker.run = run
    payload = {"op": "forward", "loss_fn": loss_fn, "loss_fn_config": {}, "data": [{
        "tokens": wt(tokens), "loss_fn_inputs": {"target_tokens": wt(targets), "logprobs": wt(floats, "float32"),
                                                 "advantages": wt(floats, "float32"),
                                                 "weights": wt(floats, "float32")}}]}
    response = httpx.post(f"{worker.base_url}/v1/training_runs/{run.training_run_id}/ops",
                          json={"seq_id": run._next_seq, "payload": payload}, timeout=30)
    valid = (loss_fn != "bogus" and len(tokens) > 0 and len(tokens) == len(targets) == len(floats)
             and all(0 <= t < VOCAB for t in tokens) and all(0 <= t < VOCAB or t == -100 for t in targets)
             and all(np.isfinite(floats)))
    if valid:
        assert response.status_code == 200, response.text
        run._next_seq += 1
    else:
        assert 400 <= response.status_code < 500, response.text
        assert response.json()["error"]["message"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    max_tokens=st.integers(-5, 20), num_samples=st.integers(-2, 6),
    temperature=st.floats(-2, 3), top_p=st.floats(-0.5, 1.5), top_k=st.integers(-3, 50),
    stop=st.one_of(st.none(), st.lists(st.integers(-3, 600), max_size=3)),
)
def test_fuzzed_sampling_params_get_an_answer_not_a_crash(worker, service, max_tokens, num_samples, temperature,
                                                          top_p, top_k, stop):
    sampler = getattr(test_fuzzed_sampling_params_get_an_answer_not_a_crash, "sampler", None) or \
        service.create_sampling_client(base_model="tiny")
    test_fuzzed_sampling_params_get_an_answer_not_a_crash.sampler = sampler
    params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "stop_token_ids": stop}
    response = httpx.post(f"{worker.base_url}/v1/samplers/{sampler.sampler_id}/sample", timeout=30,
                          json={"prompt_tokens": [3, 4, 5], "num_samples": num_samples, "sampling_params": params})
    valid = (max_tokens >= 1 and num_samples >= 1 and temperature >= 0 and 0 < top_p <= 1 and top_k >= -1
             and (stop is None or all(0 <= s < VOCAB for s in stop)))
    assert (response.status_code == 200) == valid, (params, num_samples, response.text)
    if not valid:
        assert response.status_code in (400, 413), response.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stop=st.lists(st.text(max_size=90), max_size=20),
    stop_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=1100)),
)
def test_fuzzed_stop_strings_are_bounded(worker, service, stop, stop_ids):
    sampler = getattr(test_fuzzed_stop_strings_are_bounded, "sampler", None) or \
        service.create_sampling_client(base_model="tiny")
    test_fuzzed_stop_strings_are_bounded.sampler = sampler
    response = httpx.post(f"{worker.base_url}/v1/samplers/{sampler.sampler_id}/sample", timeout=30, json={
        "prompt_tokens": [3, 4, 5], "sampling_params": {"max_tokens": 3, "stop": stop, "stop_token_ids": stop_ids}})
    sizes = [len(s.encode("utf-8", "surrogatepass")) for s in stop]
    valid = len(stop) <= 16 and all(0 < n <= 256 for n in sizes) and (stop_ids is None or len(stop_ids) <= 1024)
    assert (response.status_code == 200) == valid, (len(stop), sizes, response.text)
    if not valid:
        assert response.status_code in (400, 413), response.text
        assert "stop" in response.json()["error"]["field"], response.text
