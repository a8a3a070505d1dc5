"""The official ``openai`` client against a real worker on the tiny model: chat, completions, streaming,
async, concurrency. Tokens and logprobs are checked against native ``sample`` and against transformers."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import numpy as np
import openai
import pytest
from openai_support import KEY_A, chat_prompt_ids, openai_url, reference_logprobs

import pytrio_compat as trio

IDS = {"return_token_ids": True}  # the extension that returns the sampled token ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def native(worker):
    service = trio.ServiceClient(base_url=worker.base_url, api_key=KEY_A)
    yield service.create_sampling_client(base_model="tiny")
    service.close()


def test_models_lists_the_served_base_model(client):
    ids = [m.id for m in client.models.list().data]
    # the base model first; the rest are samplers other tests of this shared worker saved (trio:// paths)
    assert ids[0] == "tiny" and all(i.startswith("trio://") for i in ids[1:])
    assert client.models.retrieve("tiny").id == "tiny"


def test_chat_renders_the_template_and_equals_native_sample(client, tokenizer, native):
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "what is 3 plus 4"}], n=3, max_tokens=10, seed=11,
        temperature=1.0, logprobs=True, extra_body=IDS)
    prompt = chat_prompt_ids(tokenizer, "what is 3 plus 4")
    assert response.prompt_token_ids == prompt
    assert response.usage.prompt_tokens == len(prompt)
    ref = native.sample(trio.ModelInput.from_ints(prompt), num_samples=3,
                        sampling_params=trio.SamplingParams(max_tokens=10, seed=11, temperature=1.0)).result()
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, seq in zip(response.choices, ref.sequences):
        assert choice.token_ids == seq.tokens
        body = seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens
        assert choice.message.content == tokenizer.decode(body, skip_special_tokens=True)
        assert choice.message.role == "assistant"
        assert choice.finish_reason == seq.stop_reason
        got = [entry.logprob for entry in choice.logprobs.content]
        np.testing.assert_allclose(got, seq.logprobs[:len(body)], atol=1e-5)
    assert response.usage.completion_tokens == sum(len(s.tokens) for s in ref.sequences)
    assert response.usage.total_tokens == len(prompt) + response.usage.completion_tokens


def test_text_parts_are_joined_like_a_string_content(client):
    as_text = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "what is 3 plus 4"}], max_tokens=5, seed=4,
        extra_body=IDS)
    as_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "what is "},
                                                             {"type": "text", "text": "3 plus 4"}]}],
        max_tokens=5, seed=4, extra_body=IDS)
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids
    assert as_parts.choices[0].token_ids == as_text.choices[0].token_ids


def test_greedy_tokens_and_top_logprobs_equal_transformers(client, tokenizer, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype="float32").eval()
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "solve this problem"}], max_completion_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=IDS)
    choice = response.choices[0]
    prompt = chat_prompt_ids(tokenizer, "solve this problem")
    tokens = choice.token_ids
    chosen, top_ids, top_lps = reference_logprobs(model, prompt + tokens, len(prompt), 3)
    assert [ids[0] for ids in top_ids] == tokens  # greedy: each token is the most likely one
    for i, entry in enumerate(choice.logprobs.content):
        assert entry.logprob == pytest.approx(float(chosen[i]), abs=1e-4)
        assert entry.token == tokenizer.decode([tokens[i]])
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top_ids[i]]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], top_lps[i], atol=1e-4)


def test_completions_accept_text_and_token_ids_and_several_prompts(client, tokenizer, native):
    ids = tokenizer("the answer is")["input_ids"]
    by_text = client.completions.create(model="tiny", prompt="the answer is", max_tokens=7, seed=3, extra_body=IDS)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=7, seed=3, extra_body=IDS)
    assert by_text.choices[0].token_ids == by_ids.choices[0].token_ids
    assert by_text.choices[0].text == by_ids.choices[0].text
    ref = native.sample(trio.ModelInput.from_ints(ids), sampling_params=trio.SamplingParams(max_tokens=7, seed=3))
    assert by_text.choices[0].token_ids == ref.result().sequences[0].tokens
    many = client.completions.create(model="tiny", prompt=["one plus", "two times"], n=2, max_tokens=4, seed=5,
                                     logprobs=2, extra_body=IDS)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    lengths = [len(tokenizer(text)["input_ids"]) for text in ("one plus", "two times")]
    assert many.usage.prompt_tokens == sum(lengths)
    second = client.completions.create(model="tiny", prompt="two times", n=2, max_tokens=4, seed=5, extra_body=IDS)
    assert [c.token_ids for c in many.choices[2:]] == [c.token_ids for c in second.choices]
    lp = many.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == many.choices[0].text or many.choices[0].finish_reason == "stop"


def test_stop_sequence_cuts_the_text(client):
    free = client.completions.create(model="tiny", prompt="what is 12 minus 5", max_tokens=16, temperature=0,
                                     extra_body=IDS).choices[0]
    text = free.text
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = text.find(stop)
    stopped = client.completions.create(model="tiny", prompt="what is 12 minus 5", max_tokens=16, temperature=0,
                                        stop=[stop], logprobs=0).choices[0]
    assert stopped.text == text[:cut]
    assert stopped.finish_reason == "stop"
    assert len(stopped.logprobs.token_logprobs) < len(free.token_ids)


def test_streaming_chat_joins_to_the_full_answer_with_usage(client, worker):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first step"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, seed=2, n=2, logprobs=True)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, seed=2, n=2,
                                            logprobs=True, stream=True, stream_options={"include_usage": True})
    text, logprobs, finish, usage = {0: "", 1: ""}, {0: [], 1: []}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.logprobs is not None:
                logprobs[c.index] += [e.logprob for e in c.logprobs.content]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for choice in full.choices:
        assert text[choice.index] == choice.message.content
        assert logprobs[choice.index] == [e.logprob for e in choice.logprobs.content]
        assert finish[choice.index] == choice.finish_reason
    assert usage.model_dump() == full.usage.model_dump()
    raw = httpx.post(openai_url(worker) + "/completions", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60,
                     json={"model": "tiny", "prompt": "so we get", "max_tokens": 3, "stream": True})
    events = [line for line in raw.text.splitlines() if line.startswith("data: ")]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_async_client_chat_and_streaming_completion(worker):
    async def main():
        async with openai.AsyncOpenAI(base_url=openai_url(worker), api_key=KEY_A, max_retries=0) as client:
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "then"}], max_tokens=5, seed=8, extra_body=IDS)
            stream = await client.completions.create(model="tiny", prompt="then", max_tokens=5, seed=8, stream=True)
            pieces = [c.choices[0].text async for c in stream if c.choices]
            plain = await client.completions.create(model="tiny", prompt="then", max_tokens=5, seed=8)
            return chat, "".join(pieces), plain

    chat, streamed, plain = asyncio.run(main())
    assert len(chat.choices[0].token_ids) >= 1
    assert streamed == plain.choices[0].text


def test_sixteen_concurrent_requests_equal_their_solo_answers(client):
    def ask(seed: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"problem {seed}"}], max_tokens=8, seed=seed,
            logprobs=True, extra_body=IDS).choices[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16)))
    for seed in (0, 7, 15):  # decoded together or alone, the same sample
        alone = ask(seed)
        assert together[seed].token_ids == alone.token_ids
        np.testing.assert_allclose([e.logprob for e in together[seed].logprobs.content],
                                   [e.logprob for e in alone.logprobs.content], atol=1e-4)
    assert len({tuple(c.token_ids) for c in together}) > 1
