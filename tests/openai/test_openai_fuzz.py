"""Hypothesis-generated malformed requests on the OpenAI-compatible routes of a real worker.

Well-formed chat and completion bodies with fields replaced by anything (wrong types, nested garbage,
NaN, huge numbers), huge ``n`` and ``max_tokens``, giant stop lists, bad messages and prompts, bad
models (unknown names, other tenants' checkpoints, odd paths), unsupported fields, wrong content types
and bodies that are not JSON at all (garbage, truncated, deeply nested). None may get a 5xx or a
server error (in the answer or inside a stream), every refusal has OpenAI's error shape, no tenant's
weights or Adam state change, and a well-formed chat request of another tenant, looping meanwhile,
keeps answering the same text. Run with -s to see the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_support import KEY_A, KEY_B, openai_url

from pytrio_compat.types.tensor import WireTensor

EXAMPLES = 250
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "1 + 1 ="}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "1 + 1 =", "max_tokens": 2, "temperature": 0}
CHAT_FIELDS = ["model", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "return_token_ids", "tools",
               "logit_bias", "frequency_penalty", "response_format", "user", "nonsense"]
COMPLETION_FIELDS = ["model", "prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
                     "stream", "logprobs", "echo", "best_of", "suffix", "nonsense"]
PROBE = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}

huge = st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, 2**70, -2**63 - 1, 10**30])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), huge,
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=16),
                    st.sampled_from(["tiny", "text", "image_url", "user", "system", "tool", "", "0", "a\ud800",
                                     "\udfff"]))  # lone surrogates: valid JSON escapes, not valid text
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "image_url", "include_usage", "name", "x"]), inner,
    max_size=4), max_leaves=16)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "robot", ""]),
                                           "content": st.one_of(st.text(max_size=20), junk, st.lists(
                                               st.fixed_dictionaries({"type": st.sampled_from(
                                                   ["text", "image_url", "input_audio"]), "text": junk}),
                                               max_size=3))}), max_size=3)
prompts = st.one_of(st.lists(st.integers(-2**40, 2**40), max_size=6),
                    st.lists(st.lists(st.integers(-3, 600), max_size=4), max_size=3),
                    st.lists(st.text(max_size=8), max_size=3), st.just(""), st.just([]), st.just([[]]))
# long lists of one wrongly typed item: pydantic once built one error per item and the worker turned them all into
# dicts (a 0.9 MiB body stalled every tenant for seconds)
long_lists = st.builds(lambda item, n: [item] * n, st.sampled_from(["a", [], {}, None, True, 1, 2**70, [[]], 1.5]),
                       st.sampled_from([1000, 100_000]))
stops = st.one_of(st.lists(st.text(max_size=6), min_size=5, max_size=300), st.text(min_size=257, max_size=3000),
                  st.lists(st.text(min_size=300, max_size=400), min_size=1, max_size=2), st.just([""]))


def targeted(name: str, models: list[str]):
    """Values aimed at one field's checks; anything else is plain junk."""
    if name in ("n", "max_tokens", "max_completion_tokens", "top_logprobs", "logprobs", "top_k", "seed",
                "best_of"):
        return st.one_of(st.integers(-3, 2**12), huge, junk)
    if name == "stop":
        return st.one_of(stops, long_lists, junk)
    if name == "model":
        return st.one_of(st.sampled_from(models), st.text(max_size=30), junk)
    if name == "messages":
        return st.one_of(messages, long_lists, long_lists.map(lambda items: [{"role": "user", "content": items}]),
                         junk)
    if name == "prompt":
        return st.one_of(prompts, long_lists, long_lists.map(lambda items: [items]), junk)
    if name in ("temperature", "top_p"):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True), huge, junk)
    return junk


def raw_bodies():
    """Bodies that are not a JSON object: garbage, truncated JSON, other JSON values, deep nesting."""
    text = json.dumps(CHAT)
    return st.one_of(st.binary(max_size=64), st.integers(1, len(text) - 1).map(lambda k: text[:k].encode()),
                     st.sampled_from([b"[]", b"null", b"3", b'"chat"', b"", b"\xff\xfe{}"]),
                     st.sampled_from([1000, 100_000]).map(lambda depth: b"[" * depth + b"]" * depth),
                     st.sampled_from([1000, 100_000]).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth))


@pytest.fixture(scope="module")
def fuzz_worker(worker_factory):
    # small sampling limits, so a fuzzed request that happens to be valid samples a few tokens at most
    return worker_factory("--max-sample-tokens", "8", "--max-num-samples", "4", api_keys=[KEY_A, KEY_B])


class Tenant:
    """A tenant's training run, through the native API: its weights can be fingerprinted."""

    def __init__(self, base: str, key: str, storage) -> None:
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        self.storage = storage
        self.run = self.http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}
                                  ).json()["training_run_id"]
        self.seq = 0

    def op(self, payload: dict) -> dict:
        self.seq += 1
        accepted = self.http.post(f"/v1/training_runs/{self.run}/ops", json={"seq_id": self.seq, "payload": payload})
        status = self.http.get(f"/v1/requests/{accepted.json()['request_id']}", params={"wait": 30}).json()
        assert status["status"] == "succeeded", status
        return status["result"]

    def fingerprint(self, name: str) -> dict[str, bytes]:
        from server_mock.storage.checkpoints import CheckpointStore, parse_path

        path = self.op({"op": "save_state", "name": name})["path"]
        return CheckpointStore(self.storage).fingerprint(parse_path(path))


def _check_answer(response: httpx.Response, what) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (what, error)
        assert error["type"] != "server_error" and error["code"] != "internal_error", (what, error)
    elif "text/event-stream" in response.headers.get("content-type", ""):
        assert "server_error" not in response.text and "internal_error" not in response.text, (what, response.text)


def _probe(http: httpx.Client) -> tuple[str, float]:
    start = time.perf_counter()
    r = http.post("/chat/completions", json=PROBE)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], time.perf_counter() - start


@pytest.mark.timeout(600)
def test_malformed_openai_requests_never_crash_or_change_weights(fuzz_worker):
    storage = fuzz_worker.storage
    tenants = [Tenant(fuzz_worker.base_url, key, storage) for key in (KEY_A, KEY_B)]
    for i, tenant in enumerate(tenants):  # trained once, so weights and Adam state are not zero
        ids = np.asarray([(7 * k + i) % 480 + 10 for k in range(20)], dtype=np.int64)
        datum = {"tokens": WireTensor.from_array(ids[:-1]).model_dump(),
                 "loss_fn_inputs": {"target_tokens": WireTensor.from_array(ids[1:]).model_dump()}}
        tenant.op({"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum]})
        tenant.op({"op": "optim_step", "adam_params": {"learning_rate": 1e-2}})
    samplers = [t.op({"op": "save_weights_for_sampler", "name": "w"})["path"] for t in tenants]
    before = [t.fingerprint("before") for t in tenants]
    models = ["tiny", samplers[1], samplers[1] + "x", samplers[0].replace("sampler", "state"),
              "trio://../../etc/passwd", "trio://run-x/sampler/a", "/etc/passwd", "tiny\x00", "TINY"]

    api = openai_url(fuzz_worker)
    attacker = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    probe_http = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60)
    expected, _ = _probe(probe_http)
    alone = [_probe(probe_http)[1] for _ in range(10)]
    during: list[float] = []
    answers: set[str] = set()
    stop = threading.Event()

    def probe_loop() -> None:
        while not stop.is_set():
            text, seconds = _probe(probe_http)
            answers.add(text)
            during.append(seconds)

    sent: set[bytes] = set()
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(kind=st.sampled_from(["chat", "chat", "chat", "completion", "completion", "completion", "model",
                                 "content-type", "raw"]), data=st.data())
    def malformed(kind: str, data) -> None:
        path = data.draw(st.sampled_from(["/chat/completions", "/completions"]))
        headers = {"Content-Type": "application/json"}
        if kind in ("chat", "completion"):
            path = "/chat/completions" if kind == "chat" else "/completions"
            body = dict(CHAT if kind == "chat" else COMPLETION)
            fields = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
            for name in data.draw(st.lists(st.sampled_from(fields), unique=True, min_size=1, max_size=3)):
                if data.draw(st.integers(0, 5)) == 0:
                    body.pop(name, None)
                else:
                    body[name] = data.draw(targeted(name, models))
            content = json.dumps(body).encode()  # NaN and Infinity as Python's json writes them
        elif kind == "model":  # a model this tenant may not use: unknown, another tenant's, not a sampler
            body = dict(CHAT if path == "/chat/completions" else COMPLETION)
            body["model"] = data.draw(st.one_of(st.sampled_from(models[1:]), st.text(min_size=1, max_size=30)))
            content = json.dumps(body).encode()
        elif kind == "content-type":
            content = json.dumps(CHAT if path == "/chat/completions" else COMPLETION).encode()
            ctype = data.draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "", None,
                                               "multipart/form-data; boundary=x", "application/jsonx", "text/json"]))
            headers = {} if ctype is None else {"Content-Type": ctype}
        else:
            content = data.draw(raw_bodies())
        sent.add(path.encode() + json.dumps(headers).encode() + content)
        response = attacker.post(path, content=content, headers=headers)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        _check_answer(response, (path, headers, content[:300]))
        if kind == "content-type":
            assert response.status_code == 415, response.text
        elif kind == "model":
            assert response.status_code in (400, 404), response.text

    thread = threading.Thread(target=probe_loop, daemon=True)
    thread.start()
    try:
        malformed()
    finally:
        stop.set()
        thread.join(60)
    assert answers == {expected}, answers
    assert [t.fingerprint("after") for t in tenants] == before
    log = (storage.parent / "worker.log").read_text()
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]
    p50, p50_during = statistics.median(alone), statistics.median(during)
    p95_during = sorted(during)[int(0.95 * (len(during) - 1))]
    print(f"\nopenai fuzz: {len(sent)} distinct malformed requests, statuses {sorted(statuses.items())}; "
          f"well-formed chat (4 tokens): alone p50 {p50 * 1000:.0f} ms; during the attack p50 "
          f"{p50_during * 1000:.0f} ms, p95 {p95_during * 1000:.0f} ms, max {max(during) * 1000:.0f} ms "
          f"over {len(during)} requests")
    assert len(sent) >= EXAMPLES * 0.7 and during, (len(sent), len(during))
    assert p50_during < max(1.0, 10 * p50), (p50, p50_during)
    for client in (attacker, probe_http, *(t.http for t in tenants)):
        client.close()


def test_tiny_temperatures_sample_the_best_token():
    """Found by the fuzzing above: a temperature of 1e-280 made logits / temperature overflow (NaN
    probabilities, a 500). Any temperature > 0 is now a distribution: at tiny ones, all mass on the
    best token (shared equally by tied ones), as the limit of softmax(logits / T) says."""
    import torch

    from server_mock.sampling.token_choice import filtered_probs

    logits = torch.tensor([[0.5, 3.0, -2.0, 1.0], [7.0, -1.0, 7.0, 2.0]])
    for temperature in (5e-324, 8.874889613338247e-280, 1e-30, 1e-21):
        for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.3)):
            probs = filtered_probs(logits, temperature, top_k, top_p)
            assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0])), (temperature, top_k, top_p, probs)
            best = probs[1][[0, 2]]  # the tied best tokens hold all the mass (top-p may keep just one of them)
            assert probs[1][[1, 3]].sum() == 0 and best.sum() == 1, (temperature, top_k, top_p, probs)
            assert top_p < 1.0 or torch.equal(best, torch.tensor([0.5, 0.5])), probs
    manual = torch.softmax(logits.double() / 0.5, dim=-1).float()  # an ordinary temperature is unchanged
    torch.testing.assert_close(filtered_probs(logits, 0.5, 0, 1.0), manual)
