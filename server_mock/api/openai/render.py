"""Text in and out of the OpenAI-compatible API: chat templates, stop sequences, logprobs, response bodies.

Everything here is pure (no service, no HTTP): prompts become token ids, and the worker's sampled
sequences (``{"tokens", "logprobs", "stop_reason"}``, the native ``sample`` result) become OpenAI choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from server_mock.errors import WorkerError


@dataclass
class Choice:
    index: int
    text: str  # the answer: a final stop token dropped, cut before the first stop sequence
    tokens: list[int]  # the tokens the text is made of
    logprobs: list[float]  # their log-probabilities (the model's, as native sample returns them)
    top: list[list[tuple[int, float]]] | None  # for each of those tokens, the k most likely tokens
    finish_reason: str  # "stop" or "length"
    token_ids: list[int]  # every sampled token, exactly as native sample returns them


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt of a chat: the model's chat template with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise WorkerError(400, "no_chat_template", "model: this model has no chat template; use /completions with "
                                                   "a prompt instead", "model")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation (e.g. role order)
        raise WorkerError(400, "invalid_value", f"messages: the model's chat template refused them: {exc}",
                          "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def split_images(tokens: list[int], marker_id: int | None, images: list[tuple[bytes, str, str]],
                 ) -> tuple[list[int], list[tuple[int, bytes, str, str]]]:
    """A rendered chat with images: its text tokens without the template's image markers, and each image with the
    number of text tokens before it (where its marker was)."""
    if not images:
        return tokens, []
    text: list[int] = []
    placed: list[tuple[int, bytes, str, str]] = []
    for token in tokens:
        if token == marker_id and len(placed) < len(images):
            placed.append((len(text), *images[len(placed)]))
        else:
            text.append(token)
    if len(placed) != len(images):
        raise WorkerError(400, "invalid_value", f"messages: the model's chat template placed {len(placed)} of the "
                                                f"{len(images)} images", "messages")
    return text, placed


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    return list(prompt)


def finish(tokenizer, index: int, sequence: dict, stop: list[str], stop_ids: set[int],
           top: list[list[tuple[int, float]]] | None = None) -> Choice:
    """One sampled sequence as an OpenAI choice."""
    token_ids = list(sequence["tokens"])
    logprobs = list(sequence["logprobs"])
    reason = sequence.get("stop_reason") or "length"
    body = token_ids
    if reason == "stop" and body and body[-1] in stop_ids:
        body = body[:-1]
    text = tokenizer.decode(body, skip_special_tokens=True)
    cut = min((pos for pos in (text.find(s) for s in stop) if pos >= 0), default=-1)
    if cut >= 0:
        text, reason = text[:cut], "stop"
        keep = len(body)
        while keep > 0 and len(tokenizer.decode(body[:keep - 1], skip_special_tokens=True)) >= cut:
            keep -= 1  # drop the tokens that only spell the stop sequence
        body = body[:keep]
    return Choice(index, text, body, logprobs[:len(body)], top[:len(body)] if top is not None else None,
                  "stop" if reason == "stop" else "length", token_ids)


def pieces(tokenizer, tokens: list[int], text: str) -> list[str]:
    """Split ``text`` into one piece per token, in order; the pieces join to exactly ``text``.

    Each token's piece is what it adds to the decoded text, found by decoding a short window before it
    (so the cost grows with the length, not its square). A token that ends inside a multi-byte character
    gets an empty piece; the character comes with the token that completes it.
    """
    out, emitted = [], 0
    prefix, read = 0, 0  # tokens[prefix:read] were decoded already; the window starts at prefix
    for k in range(len(tokens)):
        before = tokenizer.decode(tokens[prefix:read], skip_special_tokens=True)
        now = tokenizer.decode(tokens[prefix:k + 1], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            added = len(now) - len(before)
            prefix, read = read, k + 1
        else:
            added = 0
        end = min(len(text), emitted + added)
        out.append(text[emitted:end])
        emitted = end
    if out:
        out[-1] += text[emitted:]
    return out


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(tokenizer, choice: Choice, start: int = 0, end: int | None = None) -> dict:
    """``choice.logprobs`` of a chat choice (tokens ``start:end``): ``{"content": [...], "refusal": None}``."""
    end = len(choice.tokens) if end is None else end
    content = []
    for i in range(start, end):
        entry = _entry(tokenizer, choice.tokens[i], choice.logprobs[i])
        entry["top_logprobs"] = [_entry(tokenizer, tok, lp) for tok, lp in (choice.top[i] or [])] \
            if choice.top is not None else []
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, choice: Choice) -> dict:
    """``choice.logprobs`` of a legacy completion: tokens, token_logprobs, top_logprobs, text_offset."""
    offsets, pos = [], 0
    for piece in pieces(tokenizer, choice.tokens, choice.text):
        offsets.append(pos)
        pos += len(piece)
    tops = None
    if choice.top is not None:
        tops = [{token_text(tokenizer, tok): lp for tok, lp in (row or [])} for row in choice.top]
    return {"tokens": [token_text(tokenizer, t) for t in choice.tokens], "token_logprobs": list(choice.logprobs),
            "top_logprobs": tops, "text_offset": offsets}


def _entry(tokenizer, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def chat_choice(tokenizer, choice: Choice, want_logprobs: bool, want_ids: bool) -> dict:
    out = {"index": choice.index, "message": {"role": "assistant", "content": choice.text, "refusal": None},
           "logprobs": chat_logprobs(tokenizer, choice) if want_logprobs else None,
           "finish_reason": choice.finish_reason}
    if want_ids:
        out["token_ids"] = choice.token_ids
    return out


def completion_choice(tokenizer, choice: Choice, want_logprobs: bool, want_ids: bool) -> dict:
    out = {"index": choice.index, "text": choice.text,
           "logprobs": completion_logprobs(tokenizer, choice) if want_logprobs else None,
           "finish_reason": choice.finish_reason}
    if want_ids:
        out["token_ids"] = choice.token_ids
    return out


def chat_chunks(tokenizer, choice: Choice, want_logprobs: bool, want_ids: bool) -> list[dict]:
    """The stream of one chat choice: the role, one delta per token, then the finish reason."""
    chunks = [{"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
               "finish_reason": None}]
    for i, piece in enumerate(pieces(tokenizer, choice.tokens, choice.text)):
        chunks.append({"index": choice.index, "delta": {"content": piece},
                       "logprobs": chat_logprobs(tokenizer, choice, i, i + 1) if want_logprobs else None,
                       "finish_reason": None})
    last = {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason}
    if want_ids:
        last["token_ids"] = choice.token_ids
    return chunks + [last]


def completion_chunks(tokenizer, choice: Choice, want_logprobs: bool, want_ids: bool) -> list[dict]:
    """The stream of one legacy completion choice: one text piece per token, then the finish reason."""
    full = completion_logprobs(tokenizer, choice) if want_logprobs else None
    chunks = []
    for i, piece in enumerate(pieces(tokenizer, choice.tokens, choice.text)):
        logprobs = None
        if full is not None:
            logprobs = {key: (value[i:i + 1] if value is not None else None) for key, value in full.items()}
        chunks.append({"index": choice.index, "text": piece, "logprobs": logprobs, "finish_reason": None})
    last = {"index": choice.index, "text": "", "logprobs": None, "finish_reason": choice.finish_reason}
    if want_ids:
        last["token_ids"] = choice.token_ids
    return chunks + [last]
