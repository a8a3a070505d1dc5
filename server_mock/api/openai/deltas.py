"""The text of a streamed choice, as its tokens arrive: what can be sent now, and what must wait.

``ChoiceText`` decodes incrementally: each new token is decoded with the few tokens before it (the window since
the last complete character), so the cost per token does not grow with the answer. Text is sent only when it is
complete: a token that ends inside a multi-byte UTF-8 character adds nothing until the token that completes it.
With stop sequences, a tail that could be the start of one is held back until the next tokens tell (and
nothing past a stop sequence is ever sent). When the row ends, ``rest`` reconciles with the answer as the
unstreamed request renders it (``render.finish``), so the pieces sent join to exactly its text, and the tokens
sent with them are exactly its tokens.
"""

from __future__ import annotations

import logging

from server_mock.api.openai.render import Choice

logger = logging.getLogger("server_mock")


class ChoiceText:
    """One choice's tokens and text so far, and how much of them was sent."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.starts: list[int] = []  # where each token's text starts in ``text``
        self.text = ""  # the complete characters decoded so far
        self.sent_chars = 0
        self.sent_tokens = 0
        self.stopped = False  # a stop sequence was found: nothing more is sent until the row ends
        self.finished = False
        self._prefix = self._read = 0  # tokens[_prefix:_read] decode to the window's text so far, ``_before``
        self._before = ""

    def add(self, token: int, logprob: float) -> None:
        self.starts.append(len(self.text))
        self.tokens.append(token)
        self.logprobs.append(logprob)
        now = self.tokenizer.decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if len(now) > len(self._before) and not now.endswith("\ufffd"):
            self.text += now[len(self._before):]
            self._prefix, self._read = self._read, len(self.tokens)
            self._before = self.tokenizer.decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)

    def ready(self) -> tuple[str, int, int]:
        """The text that can be sent now, and the tokens it comes with (``tokens[start:end]``); marks them sent."""
        if self.stopped or self.finished:
            return "", self.sent_tokens, self.sent_tokens
        return self._send(self._safe_end())

    def rest(self, choice: Choice) -> tuple[str, int, int]:
        """The row has ended as ``choice`` (the unstreamed answer): the rest of its text and tokens."""
        self.finished = True
        sent = self.text[:self.sent_chars]
        if not choice.text.startswith(sent) or self.sent_tokens > len(choice.tokens):
            # (not for the byte-level tokenizers; a decoder that rewrites earlier text could do it)
            logger.warning("openai: a streamed choice's text differs from its answer after %d characters",
                           self.sent_chars)
        start = min(self.sent_tokens, len(choice.tokens))
        text = choice.text[self.sent_chars:] if len(choice.text) > self.sent_chars else ""
        self.sent_chars, self.sent_tokens = max(self.sent_chars, len(choice.text)), len(choice.tokens)
        return text, start, len(choice.tokens)

    def _safe_end(self) -> int:
        """How far the text may be sent: up to a stop sequence found in it, else short of a tail that could begin
        one."""
        text, start = self.text, self.sent_chars
        if not self.stop:
            return len(text)
        found = [at for at in (text.find(s, start) for s in self.stop) if at >= 0]
        if found:
            self.stopped = True
            return min(found)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text) - start), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold

    def _send(self, end: int) -> tuple[str, int, int]:
        end = max(end, self.sent_chars)
        text = self.text[self.sent_chars:end]
        first = self.sent_tokens
        last = first
        while last < len(self.tokens) and self.starts[last] < end:
            last += 1
        self.sent_chars, self.sent_tokens = end, last
        return text, first, last
