"""The OpenAI API's errors (OpenAI's shape, the right status, the field named; unsupported fields refused)
and sampling from a checkpoint trained through the SDK, which only its own tenant can see and use."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from openai_support import KEY_A, KEY_B, chat_prompt_ids, openai_url, start_worker

import pytrio_compat as trio

IDS = {"return_token_ids": True}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def other_tenant(worker):
    with openai.OpenAI(base_url=openai_url(worker), api_key=KEY_B, max_retries=0, timeout=120) as c:
        yield c


def _error(call, status: int, param: str | None, code: str | None = None):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    err = info.value
    assert err.status_code == status, err.message
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param, body
    if code is not None:
        assert body["code"] == code, body
    if param is not None:
        assert param in body["message"]
    return body


def test_unknown_model_and_unknown_endpoint_are_404(client, worker):
    body = _error(lambda: client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2),
                  404, "model", "model_not_found")
    assert body["type"] == "invalid_request_error" and "tiny" in body["message"]
    _error(lambda: client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2, stream=True),
           404, "model", "model_not_found")  # a stream that cannot start is a plain error, not an event
    _error(lambda: client.models.retrieve("gpt-4o"), 404, "model")
    _error(lambda: client.embeddings.create(model="tiny", input="x"), 404, None, "unknown_url")


def test_wrong_key_is_an_authentication_error(worker):
    with openai.OpenAI(base_url=openai_url(worker), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
    assert info.value.response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1].image_url.url"),  # only data: URLs are taken
    ({"messages": [{"role": "user", "content": "a", "name": "bob"}]}, "messages[0].name"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"n": "2"}}, "n"),
])
def test_bad_fields_are_400_naming_the_field(client, kwargs, param):
    args = {"model": "tiny", "messages": HELLO, "max_tokens": 2, **kwargs}
    if "max_completion_tokens" in kwargs:
        args["max_tokens"] = 3
    _error(lambda: client.chat.completions.create(**args), 400, param)


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"user": "someone"}, "user"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
])
def test_unsupported_chat_fields_are_refused(client, kwargs, param):
    _error(lambda: client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, **kwargs),
           400, param, "unsupported_parameter")


def test_fields_that_ask_for_nothing_are_accepted(client):
    response = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=2, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
        response_format={"type": "text"}, tools=None)
    assert response.choices[0].finish_reason in ("stop", "length")
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=2, echo=False, best_of=1)
    assert plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, param", [({"echo": True}, "echo"), ({"best_of": 2}, "best_of"),
                                           ({"suffix": "end"}, "suffix")])
def test_unsupported_completion_fields_are_refused(client, kwargs, param):
    _error(lambda: client.completions.create(model="tiny", prompt="hello", max_tokens=2, **kwargs),
           400, param, "unsupported_parameter")
    _error(lambda: client.completions.create(model="tiny", prompt="hello", max_tokens=2, logprobs=6), 400, "logprobs")


def test_limits_are_413_and_name_the_limit(client):
    body = _error(lambda: client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, n=300),
                  413, "n")
    assert "max_num_samples=256" in body["message"]
    body = _error(lambda: client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=9000), 413,
                  "max_tokens")
    assert "max_sample_tokens=8192" in body["message"]
    body = _error(lambda: client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=2047),
                  413, "max_completion_tokens", "context_length_exceeded")
    assert "max_seq_len=2048" in body["message"]
    body = _error(lambda: client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                                         stop=["ok", "x" * 300]), 413, "stop")
    assert body["message"].startswith("stop[1]: 300 bytes") and "max_stop_string_bytes=256" in body["message"]
    body = _error(lambda: client.completions.create(model="tiny", prompt=[9999], max_tokens=2), 400, "prompt")
    assert "vocabulary" in body["message"]


def test_malformed_bodies(worker):
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    url = openai_url(worker) + "/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", headers=headers)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] == "body"
    missing = httpx.post(url, json={"model": "tiny"}, headers=headers)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    assert missing.json()["error"]["code"] == "missing_required_parameter"


def test_queue_limit_is_429(tiny_model_dir, tmp_path):
    proc = start_worker(tiny_model_dir, tmp_path, "--max-queued-requests", "1")
    try:
        with openai.OpenAI(base_url=openai_url(proc), api_key=KEY_A, max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as info:  # the second prompt finds the first queued
                client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=2)
            with pytest.raises(openai.BadRequestError) as bad:  # every prompt is checked before any is queued
                client.completions.create(model="tiny", prompt=[[5, 6], [7, 8], [9999]], max_tokens=2)
        with openai.OpenAI(base_url=openai_url(proc), api_key=KEY_A, max_retries=20) as patient:
            # the first prompt above may still be running (a loaded machine): this one, retried on the 429s as
            # Retry-After says, returns once the queue is free and its own request has finished
            patient.completions.create(model="tiny", prompt="three", max_tokens=1)
        with openai.OpenAI(base_url=openai_url(proc), api_key=KEY_A, max_retries=0) as client:
            # a failure once a stream has started arrives as an error event: here the top-logprobs pass of
            # the second choice finds the first one's queued
            stream = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, n=2,
                                                    logprobs=True, top_logprobs=1, stream=True)
            roles = []
            with pytest.raises(openai.APIError) as streamed:
                for chunk in stream:
                    roles.append(chunk.choices[0].delta.role)
            assert roles == ["assistant", "assistant"]  # sent before decoding ended
            assert "max_queued_requests=1" in streamed.value.message
        assert info.value.response.headers["Retry-After"] == "1"
        assert "max_queued_requests=1" in info.value.response.json()["error"]["message"]
        assert "9999 at position 0 of prompt 2" in bad.value.response.json()["error"]["message"]
    finally:
        proc.stop()


def test_trained_checkpoint_answers_differently_and_only_for_its_tenant(worker, client, other_tenant, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompt = chat_prompt_ids(tokenizer, "what is 2 plus 2")
    answer = tokenizer.encode("the answer is 4", add_special_tokens=False)
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
    service = trio.ServiceClient(base_url=worker.base_url, api_key=KEY_A)
    try:
        trainer = service.create_lora_training_client(base_model="tiny", rank=8, seed=0)
        for _ in range(12):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(trio.AdamParams(learning_rate=0.003)).result()
        path = trainer.save_weights_for_sampler("openai-eval").result().path
        held = trainer.save_weights_and_get_sampling_client().model_path  # in worker memory only
        native = service.create_sampling_client(model_path=path).sample(
            trio.ModelInput.from_ints(prompt), sampling_params=trio.SamplingParams(max_tokens=len(answer),
                                                                                   temperature=0)).result()
    finally:
        service.close()
    listed = {m.id: m for m in client.models.list().data}
    assert path in listed and listed[path].parent == "tiny"
    assert client.models.retrieve(path).parent == "tiny"
    assert path not in [m.id for m in other_tenant.models.list().data]

    def greedy(model: str, who=client):
        return who.chat.completions.create(model=model, messages=[{"role": "user", "content": "what is 2 plus 2"}],
                                           max_tokens=len(answer), temperature=0, logprobs=True,
                                           extra_body=IDS).choices[0]

    tuned, base = greedy(path), greedy("tiny")
    assert tuned.token_ids == answer  # learned the answer
    assert base.token_ids != answer
    assert tuned.token_ids == native.sequences[0].tokens
    assert greedy(held).token_ids == answer
    np.testing.assert_allclose([e.logprob for e in tuned.logprobs.content], native.sequences[0].logprobs, atol=1e-5)
    assert np.mean([e.logprob for e in tuned.logprobs.content]) > np.mean([e.logprob for e in base.logprobs.content])
    _error(lambda: greedy(path, other_tenant), 404, "model", "model_not_found")


def test_lazy_worker_serves_any_model_it_can_load(tiny_model_dir, tmp_path):
    proc = start_worker(tiny_model_dir, tmp_path, "--lazy-models", "--lazy-model-allow", str(tiny_model_dir),
                        "--lazy-model-allow", f"{tmp_path}/*")
    try:
        with openai.OpenAI(base_url=openai_url(proc), api_key=KEY_A, max_retries=0) as client:
            reply = client.chat.completions.create(model=str(tiny_model_dir), messages=HELLO, max_tokens=3)
            assert reply.model == str(tiny_model_dir) and reply.usage.completion_tokens >= 1
            _error(lambda: client.chat.completions.create(model=str(tmp_path / "no-model"), messages=HELLO,
                                                          max_tokens=3), 404, "model")
    finally:
        proc.stop()
