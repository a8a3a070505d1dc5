"""The official, unmodified ``tinker`` SDK against a real worker process on the tiny model.

One worker for the module, started with an API key and with the model named by its folder, so that
both ``TrainingClient.get_tokenizer()`` and ``SamplingClient.get_tokenizer()`` load it offline.
"""

from __future__ import annotations

import time
import warnings

import httpx
import numpy as np
import pytest
import tinker  # the official SDK, pinned in the dev extra
from tinker import types

WORKER_KEY = "secret-key"
CLIENT_KEY = "tml-" + WORKER_KEY  # the SDK insists on the tml- prefix; the worker accepts tml-KEY for KEY


@pytest.fixture(scope="module")
def tinker_worker(worker_factory, tiny_model_dir):
    return worker_factory(api_keys=[WORKER_KEY], model_name=str(tiny_model_dir))


@pytest.fixture(scope="module")
def model_name(tiny_model_dir):
    return str(tiny_model_dir)


@pytest.fixture()
def client(tinker_worker):
    warnings.simplefilter("ignore", FutureWarning)  # load_state* and get_server_capabilities are deprecated
    sc = tinker.ServiceClient(base_url=tinker_worker.base_url, api_key=CLIENT_KEY)
    yield sc
    sc.close("success").result(timeout=30)


def _datum(tokens: list[int], n_prompt: int, q: list[float], advantage: float) -> types.Datum:
    """An RL datum: position i predicts token i+1; the prompt positions carry A = 0 and q = 0."""
    n = len(tokens) - 1
    adv = [0.0] * (n_prompt - 1) + [advantage] * (n - n_prompt + 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * (n_prompt - 1) + list(q),
                                       "advantages": adv})


def _policy_loss(outputs, datums, kind: str, lo: float = 0.8, hi: float = 1.2) -> float:
    """The summed loss, computed here with numpy from the returned logprobs and the inputs."""
    total = 0.0
    for out, datum in zip(outputs, datums):
        lp = out["logprobs"].to_numpy().astype(np.float64)
        q = datum.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)
        a = datum.loss_fn_inputs["advantages"].to_numpy().astype(np.float64)
        r = np.exp(lp - q)
        if kind == "importance_sampling":
            total += float(np.sum(-r * a))
        else:
            total += float(np.sum(-np.minimum(r * a, np.clip(r, lo, hi) * a)))
    return total


def _probe_logprobs(training_client, probe: list[int]) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(probe[:-1]),
                        loss_fn_inputs={"target_tokens": probe[1:]})
    out = training_client.forward([datum], "cross_entropy").result(timeout=60)
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


@pytest.mark.timeout(120)
def test_grpo_loop_with_the_official_client(client, tinker_worker, model_name):
    caps = client.get_server_capabilities()
    assert model_name in [m.model_name for m in caps.supported_models]

    tc = client.create_lora_training_client(model_name, rank=8, seed=0).result(timeout=60)
    assert tc.model_id.count(":train:") == 1
    tokenizer = tc.get_tokenizer()  # a local folder: no network
    prompt_tokens = tokenizer.encode("what is two plus two?")
    prompt = types.ModelInput.from_ints(prompt_tokens)
    n_prompt = len(prompt_tokens)
    probe = tokenizer.encode("the quick brown fox jumps over the lazy dog")

    # --- sample a group; the sampler's logprobs are the trainer's numbers ---
    sampler = tc.save_weights_and_get_sampling_client()
    assert sampler.get_tokenizer().encode("hello") == tokenizer.encode("hello")
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0, stop=[])
    group = sampler.sample(prompt, num_samples=4, sampling_params=params).result(timeout=60)
    assert len(group.sequences) == 4
    again = sampler.sample(prompt, num_samples=4, sampling_params=params).result(timeout=60)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in group.sequences]  # seeded
    assert len({s.sequence_id for s in group.sequences}) == 4
    for seq in group.sequences:
        assert seq.stop_reason == "length" and len(seq.tokens) == 6 and len(seq.logprobs) == 6
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt_tokens + seq.tokens)).result(timeout=60)
        assert scored[0] is None and len(scored) == n_prompt + 6
        np.testing.assert_allclose(scored[n_prompt:], seq.logprobs, atol=1e-5)

    rewards = np.array([sum(t % 2 == 0 for t in s.tokens) for s in group.sequences], dtype=np.float64)
    advantages = rewards - rewards.mean() + np.array([0.25, -0.25, 0.5, -0.5])  # never all zero
    datums = [_datum(prompt_tokens + s.tokens, n_prompt, s.logprobs, float(a))
              for s, a in zip(group.sequences, advantages)]
    before = _probe_logprobs(tc, probe)

    # --- one GRPO step, pipelined as the cookbook does: submit both, then wait ---
    fb_future = tc.forward_backward(datums, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    optim_future = tc.optim_step(types.AdamParams(learning_rate=5e-2, eps=1e-8))
    fb = fb_future.result(timeout=60)
    optim = optim_future.result(timeout=60)
    assert all(key.count(":") == 1 for key in fb.metrics)
    assert len(fb.loss_fn_outputs) == 4
    for out, seq in zip(fb.loss_fn_outputs, group.sequences):  # same weights as the sampler: r == 1
        np.testing.assert_allclose(out["logprobs"].to_numpy()[n_prompt - 1:], seq.logprobs, atol=1e-5)
    expected = _policy_loss(fb.loss_fn_outputs, datums, "ppo")
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert fb.metrics["loss:sum"] == pytest.approx(-6 * advantages.sum(), abs=1e-3)  # r == 1: -sum(A)
    assert fb.metrics["token_count:sum"] == 6 * np.count_nonzero(np.float32(advantages))  # positions with A != 0
    assert optim.metrics["grad_norm:mean"] > 0

    # --- the weights changed: the probe's logprobs moved, in the trainer and in a new sampler ---
    after = _probe_logprobs(tc, probe)
    assert np.abs(after - before).max() > 1e-3
    sampler2 = tc.save_weights_and_get_sampling_client()
    old = sampler.compute_logprobs(types.ModelInput.from_ints(probe)).result(timeout=60)
    new = sampler2.compute_logprobs(types.ModelInput.from_ints(probe)).result(timeout=60)
    np.testing.assert_allclose(old[1:], before, atol=1e-4)  # the old sampler keeps its snapshot
    np.testing.assert_allclose(new[1:], after, atol=1e-4)

    # --- off-policy now (r != 1): importance_sampling and a tight PPO clip against numpy ---
    fwd = tc.forward(datums, "importance_sampling").result(timeout=60)
    ratios = np.concatenate([np.exp(o["logprobs"].to_numpy()[n_prompt - 1:] - np.asarray(s.logprobs))
                             for o, s in zip(fwd.loss_fn_outputs, group.sequences)])
    assert np.abs(ratios - 1).max() > 1e-3
    assert fwd.metrics["loss:sum"] == pytest.approx(_policy_loss(fwd.loss_fn_outputs, datums, "importance_sampling"),
                                                    rel=1e-4, abs=1e-4)
    clipped = tc.forward(datums, "ppo", {"clip_low_threshold": 0.999, "clip_high_threshold": 1.001}).result(timeout=60)
    assert clipped.metrics["loss:sum"] == pytest.approx(
        _policy_loss(clipped.loss_fn_outputs, datums, "ppo", 0.999, 1.001), rel=1e-4, abs=1e-4)
    assert clipped.metrics["loss:sum"] != pytest.approx(fwd.metrics["loss:sum"], rel=1e-3)

    # --- save_state / load_state_with_optimizer: weights and Adam moments both come back ---
    state = tc.save_state("step-1").result(timeout=60)
    assert state.path.startswith("tinker://") and state.path.endswith("/weights/step-1")
    at_save = _probe_logprobs(tc, probe)

    def step() -> np.ndarray:
        tc.forward_backward(datums, "importance_sampling").result(timeout=60)
        tc.optim_step(types.AdamParams(learning_rate=5e-2, eps=1e-8)).result(timeout=60)
        return _probe_logprobs(tc, probe)

    first = step()
    loaded = tc.load_state_with_optimizer(state.path).result(timeout=60)
    assert loaded.path == state.path
    np.testing.assert_allclose(_probe_logprobs(tc, probe), at_save, atol=1e-6)
    np.testing.assert_allclose(step(), first, atol=1e-5)  # the same update again: Adam state restored

    resumed = client.create_training_client_from_state_with_optimizer(state.path).result(timeout=60)
    np.testing.assert_allclose(_probe_logprobs(resumed, probe), at_save, atol=1e-6)

    # --- named sampler weights, and the same checkpoints through the worker's own protocol ---
    saved = tc.save_weights_for_sampler("sampler-1").result(timeout=60)
    assert saved.path.endswith("/sampler_weights/sampler-1")
    from_path = client.create_sampling_client(model_path=saved.path)
    scored = from_path.compute_logprobs(types.ModelInput.from_ints(probe)).result(timeout=60)
    np.testing.assert_allclose(scored[1:], _probe_logprobs(tc, probe), atol=1e-5)
    trio_path = state.path.replace("tinker://", "trio://").replace("/weights/", "/state/")
    r = httpx.get(f"{tinker_worker.base_url}/v1/checkpoint_config", params={"path": trio_path},
                  headers={"X-API-Key": WORKER_KEY})
    assert r.status_code == 200 and r.json()["has_optimizer"] is True


@pytest.mark.timeout(120)
def test_sampling_options(client, model_name):
    sampler = client.create_sampling_client(base_model=model_name).result(timeout=60)
    prompt = types.ModelInput.from_ints([10, 20, 30, 40, 50])
    # stop strings: every sequence that stopped ends with text containing the stop string
    tok = sampler.get_tokenizer()
    res = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=24, stop=["e"], seed=3)).result(timeout=60)
    stopped = [s for s in res.sequences if s.stop_reason == "stop"]
    assert stopped, "no sequence hit the stop string"
    for s in stopped:
        text = tok.decode(s.tokens)
        assert "e" in text and "e" not in tok.decode(s.tokens[:-1])
    # stop token ids, and prompt logprobs of only the last tokens
    res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=30, stop=list(range(0, 512, 2)), seed=5),
                         include_prompt_logprobs=True, topk_prompt_logprobs=3).result(timeout=60)
    for s in res.sequences:
        assert s.stop_reason == "length" or s.tokens[-1] % 2 == 0
    assert res.prompt_logprobs[0] is None and all(v is not None for v in res.prompt_logprobs[1:])
    assert res.topk_prompt_logprobs[0] is None and len(res.topk_prompt_logprobs[1]) == 3
    last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=2).result(timeout=60)
    assert last[:3] == [None, None, None]
    np.testing.assert_allclose(last[3:], res.prompt_logprobs[3:], atol=1e-5)


def _fails_fast(fn, *fragments: str, limit: float = 15.0) -> str:
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        fn()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < limit, f"took {elapsed:.1f}s to fail: {message}"
    for fragment in fragments:
        assert fragment in message
    return message


@pytest.mark.timeout(120)
def test_errors_surface_promptly_and_readably(client, tinker_worker, model_name):
    _fails_fast(lambda: client.create_lora_training_client("no-such-model").result(timeout=30),
                "no-such-model", "not served")
    tc = client.create_lora_training_client(model_name, rank=4, seed=1).result(timeout=60)
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    _fails_fast(lambda: tc.forward_backward([good], "no_such_loss").result(timeout=30),
                "unknown loss", "no_such_loss")
    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]})
    _fails_fast(lambda: tc.forward_backward([short], "cross_entropy").result(timeout=30), "shape [3]")
    _fails_fast(lambda: tc.forward([good], "ppo", {"clip_low_threshold": 2.0}).result(timeout=30),
                "clip_high_threshold")
    _fails_fast(lambda: client.create_sampling_client(model_path="tinker://run-nope/sampler_weights/x")
                .result(timeout=30), "no checkpoint at tinker://run-nope/sampler_weights/x")
    # a rejected request used up its seq_id: the training client carries on
    out = tc.forward_backward([good], "cross_entropy").result(timeout=30)
    assert out.metrics["loss:sum"] > 0
    # a wrong key is refused before anything runs
    stranger = tinker.ServiceClient(base_url=tinker_worker.base_url, api_key="tml-wrong")
    _fails_fast(lambda: stranger.create_lora_training_client(model_name).result(timeout=30), "401")
    # background and unsupported endpoints
    headers = {"X-API-Key": CLIENT_KEY}
    assert httpx.post(f"{tinker_worker.base_url}/api/v1/telemetry", json={"events": []},
                      headers=headers).json() == {"status": "accepted"}
    r = httpx.post(f"{tinker_worker.base_url}/api/v1/cancel_future", json={}, headers=headers)
    assert r.status_code == 404 and "not supported" in r.json()["detail"]
    assert httpx.post(f"{tinker_worker.base_url}/api/v1/client/config", json={}).status_code == 401


@pytest.mark.timeout(120)
def test_raw_protocol_orders_by_seq_id_and_dedupes(tinker_worker, model_name):
    """Requests sent last-first are run first-first; a re-sent seq_id gets its original future."""
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    base = tinker_worker.base_url + "/api/v1"
    headers = {"X-API-Key": CLIENT_KEY}
    http = httpx.Client(headers=headers, timeout=60)

    def result(request_id: str):
        r = http.post(f"{base}/retrieve_future", json={"request_id": request_id, "allow_metadata_only": True},
                      headers={"Accept": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        if "protobuf" in r.headers["content-type"]:
            return deserialize_forward_backward_output(r.content)
        return r.json()

    session = http.post(f"{base}/create_session", json={"tags": [], "type": "create_session"}).json()["session_id"]
    created = http.post(f"{base}/create_model", json={
        "session_id": session, "model_seq_id": 0, "base_model": model_name,
        "lora_config": {"rank": 4, "seed": 0}, "type": "create_model"}).json()
    model_id = result(created["request_id"])["model_id"]
    assert model_id == f"{session}:train:0" == created["model_id"]

    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 9, 14, 200, 31]),
                        loss_fn_inputs={"target_tokens": [9, 14, 200, 31, 7]})

    def fwd(seq_id: int, forward_only: bool, loss_fn: str = "cross_entropy") -> bytes:
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
            model_id=model_id, seq_id=seq_id)
        body = forward_backward_request_to_proto(request)
        body.forward_only = forward_only
        return body.SerializeToString()

    proto_headers = {"Content-Type": "application/x-protobuf"}
    start = time.monotonic()
    third = http.post(f"{base}/forward_backward", content=fwd(3, True), headers=proto_headers).json()
    second = http.post(f"{base}/optim_step", json={"model_id": model_id, "seq_id": 2, "type": "optim_step",
                                                   "adam_params": {"learning_rate": 1e-3}}).json()
    first = http.post(f"{base}/forward_backward", content=fwd(1, False), headers=proto_headers).json()
    assert time.monotonic() - start < 10  # early arrivals are answered at once, not held
    again = http.post(f"{base}/forward_backward", content=fwd(1, False), headers=proto_headers).json()
    assert again["request_id"] == first["request_id"]
    clash = http.post(f"{base}/forward_backward", content=fwd(1, False, "importance_sampling"),
                      headers=proto_headers).json()
    assert "different request" in result(clash["request_id"])["error"]

    out1, out3 = result(first["request_id"]), result(third["request_id"])
    assert result(second["request_id"])["metrics"]["grad_norm:mean"] > 0
    lp1 = out1.loss_fn_outputs[0]["logprobs"].to_numpy()
    lp3 = out3.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert out1.metrics["loss:sum"] == pytest.approx(-lp1.sum(), rel=1e-5)
    assert np.abs(lp3 - lp1).max() > 1e-3  # the forward ran after the optimizer step
    assert lp3.sum() > lp1.sum()  # and the step lowered the cross-entropy it was taken on

    missing = http.post(f"{base}/retrieve_future", json={"request_id": "tk-nope"})
    assert missing.status_code == 404 and "unknown request" in missing.json()["detail"]
    assert http.post(f"{base}/sessions/{session}/finish", json={"reason": {"type": "success"}}).status_code == 200
    gone = http.post(f"{base}/get_info", json={"model_id": model_id, "type": "get_info"})
    assert gone.status_code == 404
