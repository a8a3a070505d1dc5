"""``stream: true`` as the tokens are decoded: server-sent events in OpenAI's chunk format.

Each prompt's sample request carries a ``TokenChannel`` (the engine's ``TokenStream``): the decode loop tells it
each token on the model's thread as the step that sampled it ends, and the channel hands the token to the event
loop. There each choice's text is decoded incrementally (deltas.py) and sent as soon as it is complete; when a
row ends its choice is rendered as the unstreamed answer would be (render.finish), and the rest of it goes out
with its ``finish_reason``. The requests' results settle every choice whose tokens did not all come through
the channel (a host that decodes elsewhere). While no token comes (the request waits in the queue), an SSE
comment keeps the connection open. A client that hangs up cancels its requests: their rows end at the next
decode step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from server_mock.api.openai import render
from server_mock.api.openai.deltas import ChoiceText
from server_mock.api.openai.protocol import Generation
from server_mock.api.openai.render import Choice
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")

_DONE = object()


class TokenChannel:
    """One sample request's tokens, from the model's thread to a queue on the event loop (as
    ``(choice index, position, token, logprob, finished)``); ``cancelled`` is read by the decode loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, first_choice: int) -> None:
        self.loop, self.queue, self.first_choice = loop, queue, first_choice
        self.cancelled = False

    def token(self, sample: int, position: int, token: int, logprob: float, finished: str | None) -> None:
        item = (self.first_choice + sample, position, token, logprob, finished)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closing: nobody is listening
            self.cancelled = True


def channels(count: int, n: int) -> tuple[asyncio.Queue, list[TokenChannel]]:
    """A queue and one channel per prompt (prompt i's samples are choices i x n ...)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    return queue, [TokenChannel(loop, queue, i * n) for i in range(count)]


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _ChatChunks:
    """Chat completion chunks of one choice."""

    def __init__(self, tokenizer, req: Generation) -> None:
        self.tokenizer, self.req = tokenizer, req

    def content(self, index: int, state: ChoiceText, text: str, start: int, end: int) -> dict:
        logprobs = None
        if self.req.logprobs:
            part = Choice(index, "", state.tokens, state.logprobs, None, "", [])
            logprobs = render.chat_logprobs(self.tokenizer, part, start, end)
        return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}

    def last(self, choice: Choice) -> dict:
        out = {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason}
        if self.req.return_token_ids:
            out["token_ids"] = choice.token_ids
        return out


class _CompletionChunks:
    """Legacy completion chunks of one choice."""

    def __init__(self, tokenizer, req: Generation) -> None:
        self.tokenizer, self.req = tokenizer, req

    def content(self, index: int, state: ChoiceText, text: str, start: int, end: int) -> dict:
        logprobs = None
        if self.req.logprobs:
            logprobs = {"tokens": [render.token_text(self.tokenizer, t) for t in state.tokens[start:end]],
                        "token_logprobs": [float(lp) for lp in state.logprobs[start:end]], "top_logprobs": None,
                        "text_offset": state.starts[start:end]}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def last(self, choice: Choice) -> dict:
        out = {"index": choice.index, "text": "", "logprobs": None, "finish_reason": choice.finish_reason}
        if self.req.return_token_ids:
            out["token_ids"] = choice.token_ids
        return out


async def live_events(kind: str, head: dict, first: list[dict], tokenizer, req: Generation, queue: asyncio.Queue,
                      streams: list[TokenChannel], results: Callable[[], Awaitable[list[dict]]],
                      finish: Callable[[int, dict], Choice], prompt_tokens: int, keepalive: Callable[[], float],
                      error_body: Callable[[WorkerError], dict]):
    """The events of a streamed request: ``first`` at once, then each choice's text as it is decoded, its
    finish reason when its row ends, usage if asked, and ``[DONE]``; a failure as an error event
    (``error_body``). ``results()``: the sample results, one per prompt (``{"sequences": [...]}``);
    ``finish(index, sequence)``: a sampled sequence as its choice; ``keepalive()``: seconds without an event
    before a comment is sent."""
    chunks = (_ChatChunks if kind == "chat" else _CompletionChunks)(tokenizer, req)
    usage_field = {"usage": None} if req.include_usage else {}
    states = [ChoiceText(tokenizer, req.stop) for _ in range(len(streams) * req.n)]
    choices: list[Choice | None] = [None] * len(states)

    def out(chunk: dict) -> str:
        return event({**head, "choices": [chunk], **usage_field})

    def ended(index: int, seq: dict) -> list[str]:
        state = states[index]
        heard = len(state.tokens)
        for token, logprob in zip(seq["tokens"][heard:], seq["logprobs"][heard:]):  # those the stream did not hear
            state.add(token, logprob)
        choice = choices[index] = finish(index, seq)
        text, start, end = state.rest(choice)
        sent = [out(chunks.content(index, state, text, start, end))] if text or (req.logprobs and end > start) else []
        return sent + [out(chunks.last(choice))]

    async def settle():
        try:
            value = await results()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the stream, which reports it
            value = exc
        queue.put_nowait((_DONE, value))

    task = asyncio.ensure_future(settle())
    try:
        for chunk in first:
            yield out(chunk)
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), keepalive())
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if item[0] is _DONE:
                outcome = item[1]
                break
            index, position, token, logprob, finished = item
            state = states[index]
            if state.finished or position != len(state.tokens):
                continue  # a token heard already (a request decoded again after its batch failed)
            state.add(token, logprob)
            text, start, end = state.ready()
            if text:
                yield out(chunks.content(index, state, text, start, end))
            if finished is not None:
                seq = {"tokens": list(state.tokens), "logprobs": list(state.logprobs), "stop_reason": finished}
                for line in ended(index, seq):
                    yield line
        if isinstance(outcome, WorkerError):
            yield event(error_body(outcome))
            return
        if isinstance(outcome, BaseException):
            logger.error("openai: streamed request failed: %s: %s", type(outcome).__name__, outcome)
            yield event(error_body(WorkerError(500, "internal_error", f"{type(outcome).__name__}: {outcome}")))
            return
        for p, result in enumerate(outcome):
            for s, seq in enumerate(result["sequences"]):
                index = p * req.n + s
                if choices[index] is None:
                    for line in ended(index, seq):
                        yield line
        if req.include_usage:
            yield event({**head, "choices": [], "usage": render.usage(prompt_tokens, [c for c in choices if c])})
        yield "data: [DONE]\n\n"
    finally:
        if not task.done():
            for stream in streams:
                stream.cancelled = True  # the client went away: the rows end at the next decode step
            task.cancel()
