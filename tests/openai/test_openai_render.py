"""Pure parts of the OpenAI API: per-token text pieces and how a sampled sequence becomes a choice."""

from __future__ import annotations

import random

import pytest

from server_mock.api.openai.render import finish, pieces
from server_mock.engine.tiny_model import EOS_TOKEN_ID


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def _quadratic_pieces(tokenizer, ids: list[int], text: str) -> list[str]:
    """The reference: each token's piece from decoding the whole prefix up to it."""
    out, emitted = [], 0
    for k in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if prefix.endswith("\ufffd") and k < len(ids):
            out.append("")
            continue
        end = min(len(text), max(emitted, len(prefix)))
        out.append(text[emitted:end])
        emitted = end
    out[-1] += text[emitted:]
    return out


def test_pieces_join_to_the_text_and_match_whole_prefix_decoding(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        got = pieces(tokenizer, ids, text)
        assert len(got) == len(ids) and "".join(got) == text
        assert got == _quadratic_pieces(tokenizer, ids, text)


def test_a_multibyte_character_comes_with_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode("héllo ✓", add_special_tokens=False)
    got = pieces(tokenizer, ids, tokenizer.decode(ids))
    assert "é" in got and "✓" in got and "\ufffd" not in "".join(got)


def test_finish_drops_a_final_stop_token_and_cuts_at_a_stop_sequence(tokenizer):
    body = tokenizer.encode("the answer is 42 so we get", add_special_tokens=False)
    logprobs = [-0.1 * (i + 1) for i in range(len(body) + 1)]
    ended = finish(tokenizer, 3, {"tokens": body + [EOS_TOKEN_ID], "logprobs": logprobs, "stop_reason": "stop"},
                   [], {EOS_TOKEN_ID})
    assert (ended.index, ended.text, ended.finish_reason) == (3, "the answer is 42 so we get", "stop")
    assert ended.tokens == body and ended.logprobs == logprobs[:len(body)]
    assert ended.token_ids == body + [EOS_TOKEN_ID]

    cut = finish(tokenizer, 0, {"tokens": body, "logprobs": logprobs[:len(body)], "stop_reason": "length"},
                 ["42", "never"], {EOS_TOKEN_ID})
    assert cut.text == "the answer is " and cut.finish_reason == "stop"
    kept = tokenizer.decode(cut.tokens, skip_special_tokens=True)
    assert kept.startswith(cut.text) and len(tokenizer.decode(cut.tokens[:-1])) < len(cut.text)
    assert cut.logprobs == logprobs[:len(cut.tokens)]

    running = finish(tokenizer, 0, {"tokens": body, "logprobs": logprobs[:len(body)], "stop_reason": "length"},
                     ["never"], {EOS_TOKEN_ID})
    assert running.finish_reason == "length" and running.tokens == body
