"""Hypothesis-generated malformed requests from two tenants against every native route family, while a
well-formed sample request runs in a loop: every malformed request gets a 4xx (never a 5xx, never a 2xx),
the worker stays up, neither tenant's weights nor Adam state change, and the well-formed request's
latency is reported (run with -s to see the figures quoted in docs/reliability.md)."""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time

import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytrio_compat.types.tensor import WireTensor
from server_mock.storage.checkpoints import CheckpointStore, parse_path

from .reliability_helpers import KEY_A, KEY_B, datum_wire

VOCAB = 512
EXAMPLES = 400
REFUSALS = {400, 401, 403, 404, 409, 413, 415, 422}
JSON_HEADERS = {"Content-Type": "application/json"}

finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
json_junk = st.recursive(st.none() | st.booleans() | st.integers() | finite | st.text(max_size=20),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                     max_size=4), max_leaves=12)


@st.composite
def bad_forward(draw) -> dict:
    """A forward_backward whose tokens hold at least one id outside the vocabulary."""
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10))
    tokens.insert(draw(st.integers(0, len(tokens))), draw(st.one_of(st.integers(VOCAB, 2**40),
                                                                    st.integers(-2**40, -1))))
    ids = datum_wire()
    ids["tokens"] = WireTensor.from_array(np.asarray(tokens, dtype=np.int64)).model_dump()
    loss = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]))
    return {"op": "forward_backward", "loss_fn": loss, "data": [ids]}


@st.composite
def bad_adam(draw) -> dict:
    name, value = draw(st.one_of(
        st.tuples(st.just("learning_rate"), st.one_of(st.floats(max_value=-1e-9), st.just(float("nan")))),
        st.tuples(st.sampled_from(["beta1", "beta2"]), st.one_of(st.floats(min_value=1.0), st.floats(max_value=-1e-9))),
        st.tuples(st.just("eps"), st.floats(max_value=0.0)),
        st.tuples(st.just("weight_decay"), st.floats(max_value=-1e-9)),
    ))
    return {"op": "optim_step", "adam_params": {name: value}}


bad_sampling = st.one_of(
    st.fixed_dictionaries({"max_tokens": st.integers(max_value=0)}),
    st.fixed_dictionaries({"max_tokens": st.integers(8193, 2**40)}),
    st.fixed_dictionaries({"max_tokens": st.just(2), "temperature": st.floats(max_value=-1e-6)}),
    st.fixed_dictionaries({"max_tokens": st.just(2), "top_p": st.one_of(st.floats(max_value=0), st.floats(1.01))}),
    st.fixed_dictionaries({"max_tokens": st.just(2), "stop": st.lists(st.text(min_size=1, max_size=4),
                                                                       min_size=17, max_size=40)}),
    st.fixed_dictionaries({"max_tokens": st.just(2), "stop": st.lists(st.text(min_size=257, max_size=300),
                                                                       min_size=1, max_size=2)}),
    st.fixed_dictionaries({"max_tokens": st.just(2), "stop_token_ids": st.lists(st.integers(VOCAB, 10**9),
                                                                                 min_size=1, max_size=3)}),
)

# long lists of one wrongly typed item, where the shapes hold lists (each item once cost a validation error)
long_list = st.builds(lambda item, n: [item] * n, st.sampled_from(["a", [], {}, None, True, 2**70, 1.5, [[]]]),
                      st.sampled_from([1000, 100_000]))
long_list_bodies = st.one_of(
    long_list.map(lambda items: {"prompt_tokens": items, "sampling_params": {"max_tokens": 2}}),
    long_list.map(lambda items: {"prompt_tokens": [5, 6], "sampling_params": {"max_tokens": 2, "stop": items}}),
    long_list.map(lambda items: {"prompt_tokens": [5, 6], "sampling_params": {"max_tokens": 2,
                                                                              "stop_token_ids": items}}),
)
long_list_ops = st.one_of(
    long_list.map(lambda items: {"op": "forward_backward", "data": items}),
    long_list.map(lambda items: {"op": "forward_backward", "data": [{**datum_wire(), "loss_fn_inputs": {
        f"k{i}": item for i, item in enumerate(items)}}]}),
    long_list.map(lambda items: {"op": "forward", "data": [{**datum_wire(), "tokens": {
        "dtype": "int64", "shape": items, "b64": ""}}]}),
)

# (label, tenant index, what to send); the last element is built by the test with the live ids
attack = st.one_of(
    st.tuples(st.just("op"), st.integers(0, 1), st.one_of(bad_forward(), bad_adam(), json_junk, long_list_ops)),
    st.tuples(st.just("op-seq"), st.integers(0, 1), st.one_of(st.integers(-5, 0), st.integers(50, 2**31))),
    st.tuples(st.just("sample"), st.integers(0, 1), bad_sampling),
    st.tuples(st.just("sample-junk"), st.integers(0, 1), st.one_of(json_junk, long_list_bodies)),
    st.tuples(st.just("content-type"), st.integers(0, 1),
              st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "",
                               "application/json-seq", "text/json"])),
    st.tuples(st.just("host"), st.integers(0, 1), st.from_regex(r"[a-z]{1,10}\.(example|test|evil)(:[0-9]{2,5})?",
                                                                fullmatch=True)),
    st.tuples(st.just("origin"), st.integers(0, 1), st.from_regex(r"https?://[a-z]{1,10}\.(example|evil)",
                                                                  fullmatch=True)),
    st.tuples(st.just("truncated"), st.integers(0, 1), st.integers(1, 40)),
    st.tuples(st.just("wait"), st.integers(0, 1), st.sampled_from(["nan", "inf", "-inf", "-1", "x", "1e999"])),
    st.tuples(st.just("create"), st.integers(0, 1), st.one_of(
        st.fixed_dictionaries({"base_model": st.just("tiny"), "lora": st.fixed_dictionaries(
            {"rank": st.one_of(st.integers(max_value=0), st.integers(129, 10**9))})}),
        st.fixed_dictionaries({"from_checkpoint": st.text(max_size=30)}))),
)


def _timed_sample(http: httpx.Client, sampler: str) -> float:
    started = time.perf_counter()
    body = {"prompt_tokens": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0.0}}
    request_id = http.post(f"/v1/samplers/{sampler}/sample", json=body).json()["request_id"]
    status = http.get(f"/v1/requests/{request_id}", params={"wait": 30}).json()
    assert status["status"] == "succeeded", status
    return time.perf_counter() - started


def _sampling_loop(base: str, sampler: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60) as http:
        while not stop.is_set():
            latencies.append(_timed_sample(http, sampler))


def test_malformed_flood_changes_nothing_and_well_formed_requests_carry_on(special_worker):
    base = special_worker.base_url
    clients = [httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
               for key in (KEY_A, KEY_B)]
    runs, seqs, samplers = [], [], []
    for http in clients:
        run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4, "seed": 9}}).json()
        runs.append(run["training_run_id"])
        seqs.append(0)
        samplers.append(http.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"])

    def op(i: int, payload: dict) -> dict:
        seqs[i] += 1
        accepted = clients[i].post(f"/v1/training_runs/{runs[i]}/ops", json={"seq_id": seqs[i], "payload": payload})
        return clients[i].get(f"/v1/requests/{accepted.json()['request_id']}", params={"wait": 30}).json()

    def fingerprint(i: int, name: str) -> dict[str, bytes]:
        path = op(i, {"op": "save_state", "name": name})["result"]["path"]
        return CheckpointStore(special_worker.storage).fingerprint(parse_path(path))

    for i in (0, 1):  # trained once, gradients pending
        op(i, {"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum_wire(i)]})
        op(i, {"op": "optim_step", "adam_params": {"learning_rate": 1e-2}})
        op(i, {"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum_wire(i + 1)]})
    before = [fingerprint(i, "before-attack") for i in (0, 1)]

    baseline = [_timed_sample(clients[1], samplers[1]) for _ in range(15)]
    stop = threading.Event()
    during: list[float] = []
    loop = threading.Thread(target=_sampling_loop, args=(base, samplers[1], stop, during), daemon=True)
    loop.start()
    sent: set[str] = set()
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=attack)
    def malformed(case) -> None:
        kind, i, detail = case
        http, seq = clients[i], seqs[i] + 1
        url, method, params, headers = f"/v1/training_runs/{runs[i]}/ops", "POST", None, dict(JSON_HEADERS)
        # a valid op: only the defect under test may stop it (it would change the weights otherwise)
        good = json.dumps({"seq_id": seq, "payload": {"op": "optim_step", "adam_params": {"learning_rate": 1.0}}})
        if kind == "op":
            content = json.dumps({"seq_id": seq, "payload": detail})
        elif kind == "op-seq":
            content = json.dumps({"seq_id": detail, "payload": {"op": "optim_step"}})
        elif kind in ("sample", "sample-junk"):
            url = f"/v1/samplers/{samplers[i]}/sample"
            body = {"prompt_tokens": [5, 6], "sampling_params": detail} if kind == "sample" else detail
            content = json.dumps(body)
        elif kind == "content-type":
            content, headers = good, ({"Content-Type": detail} if detail else {})
        elif kind == "host":
            content, headers["Host"] = good, detail
        elif kind == "origin":
            content, headers["Origin"] = good, detail
        elif kind == "truncated":
            content = good[:detail]
        elif kind == "wait":
            url, method, params, content = f"/v1/requests/req-{detail}", "GET", {"wait": detail}, None
        else:
            url, content = "/v1/training_runs", json.dumps(detail)
        sent.add(hashlib.sha256(json.dumps([kind, i, url, method, params, headers, content]).encode()).hexdigest())
        response = http.request(method, url, content=content, params=params, headers=headers)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code in REFUSALS, (case, response.status_code, response.text)
        error = response.json().get("error") or {}
        assert error.get("message"), response.text

    try:
        malformed()
    finally:
        stop.set()
        loop.join(60)
    for http in clients:
        assert http.get("/v1/health").json()["status"] == "ok"
    assert [fingerprint(i, "after-attack") for i in (0, 1)] == before
    assert len(sent) >= EXAMPLES * 0.8, len(sent)
    p50, p50_during = statistics.median(baseline), statistics.median(during)
    p95_during = sorted(during)[int(0.95 * (len(during) - 1))]
    print(f"\nmalformed requests: {len(sent)} distinct, statuses {sorted(statuses.items())}; well-formed sample "
          f"(4 tokens): alone p50 {p50 * 1000:.0f} ms; during the attack p50 {p50_during * 1000:.0f} ms, "
          f"p95 {p95_during * 1000:.0f} ms over {len(during)} requests")
    assert during, "no well-formed request completed during the attack"
    assert p50_during < max(1.0, 10 * p50), (p50, p50_during)
    for http in clients:
        http.close()

