"""``TokenStream``: what a sample request may carry to hear of its tokens while it decodes, and to be cancelled.

The decode loop (``decode_batch.DecodeBatch``) tells a request's stream each token of each of its rows as soon as
the step that sampled it ends, and reads ``cancelled`` before every step: once it is true, the request's rows end
there (reason ``"cancelled"``) and the batch goes on for the others. Both happen on the decoding thread, so
``token`` must be cheap and must not block (hand the token to another thread, e.g. with
``loop.call_soon_threadsafe``); an exception from it is logged and the decoding goes on.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["CANCELLED", "TokenStream", "stream_cancelled"]

CANCELLED = "cancelled"  # the stop reason of a row whose stream was cancelled


class TokenStream(Protocol):
    cancelled: bool

    def token(self, sample: int, position: int, token: int, logprob: float, finished: str | None) -> None:
        """Row ``sample`` of the request sampled ``token`` (its ``position``-th, from 0) with ``logprob``;
        ``finished``: the row's stop reason if this was its last token, else None."""


def stream_cancelled(spec) -> bool:
    """Whether a request's stream (its spec's ``stream``, if it has one) was cancelled."""
    stream = getattr(spec, "stream", None)
    return stream is not None and stream.cancelled
