"""``stream: true`` as the tokens are decoded, with the official ``openai`` client against an in-process worker on
the tiny model: each token's text is sent before the decode loop runs its next step (checked against a gate that
holds the loop before each step, not against a clock), stop sequences and multi-byte characters split across
tokens, keep-alive comments while the request is queued, a client that hangs up ending its row at the next step
while the batch goes on, and streamed answers equal to the unstreamed ones. ``ChoiceText`` (the incremental
text) is checked on its own against the tokenizer's bytes."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import numpy as np
import pytest
from streaming_support import KEY, StepGate, in_process_worker, wait_until

from server_mock.api.openai import router, streaming
from server_mock.api.openai.deltas import ChoiceText
from server_mock.api.openai.render import Choice
from server_mock.engine.jobs import Job

IDS = {"return_token_ids": True}
HELLO = [{"role": "user", "content": "then"}]


@pytest.fixture(scope="module")
def running(tiny_model_dir, tmp_path_factory):
    with in_process_worker(tiny_model_dir, tmp_path_factory.mktemp("streaming")) as worker:
        yield worker


@pytest.fixture(scope="module")
def client(running):
    with openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60) as c:
        c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)  # the model loaded, its queue made
        yield c


@pytest.fixture(scope="module")
def tokenizer(running, client):
    return running.service.models.loaded("tiny").tokenizer


@pytest.fixture()
def gate(monkeypatch):
    held = StepGate(monkeypatch)
    yield held
    held.open()  # never leave the decode loop waiting
    assert not held.stuck, "a decode step waited for a test that never let it run"


def _chat_stream(chunks) -> tuple[dict, dict, dict, dict, object]:
    """Each choice's text, logprobs, finish reason and token ids from a chat stream, and its usage."""
    text, logprobs, finish, ids, usage = {}, {}, {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend((e.token, e.logprob) for e in c.logprobs.content)
            if c.finish_reason:
                assert c.index not in finish, "two finish reasons for one choice"
                finish[c.index] = c.finish_reason
                ids[c.index] = getattr(c, "token_ids", None)
    return text, logprobs, finish, ids, usage



def _completion_stream(chunks) -> tuple[dict, dict, dict, dict, dict]:
    """Each choice's text, (token, logprob) pairs, text offsets, finish reason and token ids from a legacy
    completions stream."""
    text, tokens, offsets, finish, ids = {}, {}, {}, {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
                ids[c.index] = getattr(c, "token_ids", None)
    return text, tokens, offsets, finish, ids

# --- sent as decoded ----------------------------------------------------------------------------------------------


def test_each_token_is_sent_before_the_decode_loop_runs_the_next_step(client, gate, tokenizer):
    tokens = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0,
                                            extra_body=IDS).choices[0].token_ids
    expected = [tokenizer.decode(tokens[:k], skip_special_tokens=True) for k in range(len(tokens) + 1)]
    assert all("\ufffd" not in t for t in expected) and expected[1], "the check needs a clean greedy answer"
    received: list[tuple[str, int]] = []  # each content delta, with the decode steps run when it came
    gate.hold()

    def read():
        stream = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0,
                                                stream=True)
        for chunk in stream:
            for c in chunk.choices:
                if c.delta.content:
                    received.append((c.delta.content, gate.ran))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for k in range(1, len(tokens) + 1):
        gate.let(1)  # step k samples token k; the loop then waits before step k + 1
        wait_until(lambda k=k: "".join(t for t, _ in received) == expected[k], f"the text of {k} tokens")
        assert gate.ran == k
    reader.join(60)
    assert received[0][1] == 1  # the first content chunk came while step 2 was held
    assert [steps for _, steps in received] == list(range(1, len(tokens) + 1))  # one chunk per token, in its step


def test_a_64_token_answer_is_sent_in_64_content_chunks(client):
    stream = client.completions.create(model="tiny", prompt="the answer is", max_tokens=64, temperature=0,
                                       stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    plain = client.completions.create(model="tiny", prompt="the answer is", max_tokens=64, temperature=0)
    assert len(pieces) == plain.usage.completion_tokens == 64
    assert "".join(pieces) == plain.choices[0].text


# --- stop sequences and characters split across tokens -------------------------------------------------------------


def test_a_stop_sequence_split_across_tokens_is_held_back_and_never_sent(client, tokenizer):
    free = client.completions.create(model="tiny", prompt="so we get", max_tokens=24, seed=5, extra_body=IDS)
    tokens, text = free.choices[0].token_ids, free.choices[0].text
    pieces = [tokenizer.decode(tokens[:k + 1])[len(tokenizer.decode(tokens[:k])):] for k in range(len(tokens))]
    cut_at = next(k for k in range(1, len(pieces) - 1)
                  if len(pieces[k]) > 1 and pieces[k + 1] and "\ufffd" not in pieces[k] + pieces[k + 1]
                  and (pieces[k][-1] + pieces[k + 1][0]) not in "".join(pieces[:k + 1])[:-1])
    stop = pieces[cut_at][-1] + pieces[cut_at + 1][0]  # its first character from one token, its last from the next
    cut = text.index(stop)
    assert cut == len("".join(pieces[:cut_at + 1])) - 1
    stream = client.completions.create(model="tiny", prompt="so we get", max_tokens=24, seed=5, stop=[stop],
                                       stream=True, logprobs=0)
    sent, finish, offsets, count = "", None, [], 0
    for chunk in stream:
        c = chunk.choices[0]
        sent += c.text
        if c.logprobs is not None:
            offsets += c.logprobs.text_offset
            count += len(c.logprobs.tokens)
        finish = c.finish_reason or finish
    plain = client.completions.create(model="tiny", prompt="so we get", max_tokens=24, seed=5, stop=[stop],
                                      logprobs=0).choices[0]
    assert sent == plain.text == text[:cut]
    assert finish == plain.finish_reason == "stop"
    assert offsets == plain.logprobs.text_offset and count == len(plain.logprobs.tokens) == cut_at + 1


def test_multi_byte_characters_split_across_tokens_are_sent_whole(client, tokenizer):
    body = {"model": "tiny", "prompt": "the answer is", "max_tokens": 48, "n": 8, "temperature": 1, "seed": 0}
    plain = client.completions.create(**body, extra_body=IDS)
    splits = 0
    for choice in plain.choices:
        t = choice.token_ids
        for k in range(1, len(t)):
            before, after = tokenizer.decode(t[:k]), tokenizer.decode(t[:k + 1])
            splits += before.endswith("\ufffd") and not after.endswith("\ufffd") and len(before) == len(after)
    assert splits >= 1, "the check needs a character whose bytes come from two tokens"
    streamed: dict[int, list[str]] = {}
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).append(c.text)
    for choice in plain.choices:
        assert "".join(streamed[choice.index]) == choice.text
        # a piece never ends in a replacement character that the answer does not have there
        pos = 0
        for piece in streamed[choice.index]:
            pos += len(piece)
            assert not piece.endswith("\ufffd") or choice.text[pos - 1] == "\ufffd"


def _byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of ``text``: the byte-level BPE alphabet's tokens (GPT-2's table of printable
    stand-ins for the 256 bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [tokenizer.convert_tokens_to_ids(chars[b]) for b in text.encode("utf-8")]


def test_choice_text_sends_a_character_only_with_its_last_byte(tokenizer):
    tokens = _byte_tokens(tokenizer, "aé🙂b")
    assert len(tokens) == 1 + 2 + 4 + 1 and tokenizer.decode(tokens) == "aé🙂b"
    state = ChoiceText(tokenizer, [])
    sent = []
    for t in tokens:
        state.add(t, -1.0)
        sent.append(state.ready())
    assert [text for text, _, _ in sent] == ["a", "", "é", "", "", "", "🙂", "b"]
    assert [(a, b) for text, a, b in sent if text] == [(0, 1), (1, 3), (3, 7), (7, 8)]  # each byte's token with it


def test_choice_text_holds_back_at_most_what_could_start_a_stop_sequence(tokenizer):
    def run(words: list[str], stop: list[str]) -> tuple[list[str], ChoiceText]:
        state = ChoiceText(tokenizer, stop)
        out = []
        for w in words:
            for t in tokenizer.encode(w, add_special_tokens=False):
                state.add(t, 0.0)
            out.append(state.ready()[0])
        return out, state

    # "xy" (one short of the stop "xyz") is held back exactly as long as it could still become it
    assert run(["ab", "xy", "q"], ["xyz"])[0] == ["ab", "", "xyq"]
    out, state = run(["ab", "xy", "z", "tail"], ["xyz"])
    assert out == ["ab", "", "", ""] and state.stopped  # the stop sequence and everything after: never sent
    assert run(["ab", "x"], ["yz"])[0] == ["ab", "x"]  # a tail that cannot start a stop sequence goes at once
    rest = state.rest(Choice(0, "ab", state.tokens[:1], state.logprobs[:1], None, "stop", state.tokens))
    assert rest == ("", 1, 1)  # nothing more to send: the answer is the text sent


# --- queued, cancelled ------------------------------------------------------------------------------------------------


def test_keep_alive_comments_while_queued_then_the_answer(running, client, monkeypatch):
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, seed=3)
    monkeypatch.setattr(router, "KEEPALIVE_SECONDS", 0.02)
    release = threading.Event()
    blocker = Job(request_id="hold", kind="hold", fn=lambda: (release.wait(60), {})[1], owner="another-tenant")
    running.service.models.sampling_queue("tiny").put(blocker)
    wait_until(lambda: blocker.status == "running", "the model's thread busy")
    lines, comments_before_content = [], None
    try:
        with httpx.stream("POST", running.url + "/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "messages": HELLO, "max_tokens": 6, "seed": 3,
                                "stream": True}) as response:
            for line in response.iter_lines():
                if not line:
                    continue  # the blank line that ends each event
                lines.append(line)
                if comments_before_content is None and lines.count(": keep-alive") == 3:
                    comments_before_content = [x for x in lines if x.startswith("data: ")]
                    release.set()
    finally:
        release.set()
    assert comments_before_content is not None and len(comments_before_content) == 1  # the role chunk only
    data = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in data) == plain.choices[0].message.content
    assert lines[-1] == "data: [DONE]"


def test_a_client_that_hangs_up_frees_its_row_at_the_next_step(running, client, gate, monkeypatch):
    made: list[streaming.TokenChannel] = []

    class Recorded(streaming.TokenChannel):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(streaming, "TokenChannel", Recorded)
    other = {"model": "tiny", "prompt": "then", "max_tokens": 30, "temperature": 0}
    may_hang_up, hung_up = threading.Event(), threading.Event()

    def listen_then_hang_up():
        stream = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=200, temperature=0,
                                                stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        may_hang_up.wait(60)  # once the other request decodes beside it
        stream.close()
        hung_up.set()

    gate.hold()
    listener = threading.Thread(target=listen_then_hang_up, daemon=True)
    listener.start()
    wait_until(lambda: gate.rows, "the streamed request decoding")
    answers = []
    joined = threading.Thread(target=lambda: answers.append(client.completions.create(**other)), daemon=True)
    joined.start()
    for _ in range(20):  # a step at a time, until the other request decodes in the same batch
        if gate.rows[-1] == 2:
            break
        seen = len(gate.rows)
        gate.let(1)
        wait_until(lambda seen=seen: len(gate.rows) > seen, "the next step")
    assert gate.rows[-1] == 2
    may_hang_up.set()
    wait_until(hung_up.is_set, "the client reading its first text and hanging up")
    wait_until(lambda: made and made[0].cancelled, "the worker hearing of the hang-up")
    held = len(gate.rows)  # step number `held` has begun and waits for the gate, both rows in it
    assert gate.rows[held - 1] == 2
    gate.open()
    joined.join(60)
    assert gate.rows[held] == 1  # the next step decodes the other request alone
    assert answers[0].choices[0].finish_reason == "length" and answers[0].usage.completion_tokens == 30
    ended = [job for job in running.service.requests._jobs.values()
             if job.result and [s["stop_reason"] for s in job.result.get("sequences", [])] == ["cancelled"]]
    assert len(ended) == 1 and len(ended[0].result["sequences"][0]["tokens"]) == held - 1 < 200
    alone = client.completions.create(**other)  # the batch it went on in gave it the answer it gets alone
    assert alone.choices[0].text == answers[0].choices[0].text


# --- the same answers ----------------------------------------------------------------------------------------------


def test_streamed_chat_equals_the_unstreamed_answer_with_n_logprobs_and_usage(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "what is 12 minus 5"}], "max_tokens": 20,
            "n": 3, "temperature": 1, "seed": 11, "logprobs": True, "stop": ["e"]}
    plain = client.chat.completions.create(**body, extra_body=IDS)
    text, logprobs, finish, ids, usage = _chat_stream(client.chat.completions.create(
        **body, extra_body=IDS, stream=True, stream_options={"include_usage": True}))
    for choice in plain.choices:
        assert text[choice.index] == choice.message.content
        assert logprobs.get(choice.index, []) == [(e.token, e.logprob) for e in choice.logprobs.content]
        assert finish[choice.index] == choice.finish_reason
        assert ids[choice.index] == choice.token_ids
    assert usage.model_dump() == plain.usage.model_dump()


def test_streamed_completions_of_two_prompts_equal_the_unstreamed_answers(client):
    body = {"model": "tiny", "prompt": ["then", "so we get"], "max_tokens": 10, "n": 2, "temperature": 1,
            "seed": 4, "logprobs": 0}
    plain = client.completions.create(**body)
    text, tokens, offsets, finish, _ = _completion_stream(client.completions.create(**body, stream=True))
    assert sorted(text) == [0, 1, 2, 3]
    for choice in plain.choices:
        assert text[choice.index] == choice.text
        # the two prompts are two sample requests: when they join a batch depends on timing, so the logprobs hold
        # to the batching contract (1e-4), the tokens exactly
        streamed = tokens[choice.index]
        assert [t for t, _ in streamed] == choice.logprobs.tokens
        assert np.allclose([lp for _, lp in streamed], choice.logprobs.token_logprobs, rtol=0, atol=1e-4)
        assert offsets[choice.index] == choice.logprobs.text_offset
        assert finish[choice.index] == choice.finish_reason


def test_without_the_token_stream_the_answer_comes_whole_at_the_end(client, monkeypatch):
    """Where the model decodes without the stream (a Ray replica), the results settle every choice."""
    from server_mock.sampling import decode_batch

    monkeypatch.setattr(decode_batch, "_tell", lambda *args: None)
    body = {"model": "tiny", "prompt": "so we get", "max_tokens": 10, "n": 2, "seed": 9, "logprobs": 0,
            "stop": ["e"]}
    plain = client.completions.create(**body, extra_body=IDS)
    text, tokens, offsets, _, ids = _completion_stream(client.completions.create(**body, extra_body=IDS,
                                                                                 stream=True))
    for choice in plain.choices:
        assert text[choice.index] == choice.text
        assert tokens.get(choice.index, []) == list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs))
        assert offsets.get(choice.index, []) == choice.logprobs.text_offset
        assert ids[choice.index] == choice.token_ids
