"""``SamplingSession``: one running decode batch of an in-process model, resumable between the queue's turns.

The model queue (engine/queue.py) opens a session for sample requests that share weights, adds requests to it
while it decodes (continuous admission) and runs it in slices, so that other tenants' work runs in between. A
slice may follow a training op or another sampler's slice on the same model, so each call first puts the
session's weights back (``LocalModelHost.sampling_model``: the sampler slot is reloaded only if another snapshot
took it meanwhile). The decoding itself is ``sampling.decode_batch.DecodeBatch``: a request gets the same tokens
and logprobs whether it ran alone, joined a running batch or was decoded across many slices.
"""

from __future__ import annotations

import time
from typing import Callable

from server_mock.engine.merged_lora import MergedDecoder
from server_mock.lora import Snapshot
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.sampling.generate import SampleResult, check_spec, result_of

__all__ = ["SamplingSession"]


class SamplingSession:
    """A ``DecodeBatch`` for one set of weights (a snapshot, or None for the base model) on a local host."""

    def __init__(self, host, snapshot: Snapshot | None) -> None:
        self.host, self.snapshot = host, snapshot
        started = time.perf_counter()
        # kept for the session's life, so every request of the batch decodes on the same model (merged or not)
        self.model = host.decode_model(snapshot)
        self.merged = isinstance(self.model, MergedDecoder)
        self.load_weights_s = time.perf_counter() - started
        self.batch = DecodeBatch(self.model, host.tokenizer, host.sampling_support,
                                 static=host.static_steps(self.model))
        self.requests = 0  # requests added so far (the batch_requests metric)

    def _activate(self):
        """The session's model, its weights back in place if other work ran since the last slice (a merged
        decoder holds its own weights; the PEFT slot may have been reloaded with another snapshot)."""
        if self.merged:
            return self.model
        started = time.perf_counter()
        model = self.host.sampling_model(self.snapshot)
        self.load_weights_s += time.perf_counter() - started
        return model

    @property
    def active(self) -> bool:
        return self.batch.active

    def can_add(self) -> bool:
        """Whether a request added now joins the running batch at its next step."""
        return self.batch.can_join()

    def add(self, spec) -> int:
        """Prefill a request into the batch (it decodes with the next ``run``); its handle."""
        check_spec(spec, self.host.tokenizer)
        self.batch.model = self._activate()
        self.requests += 1
        return self.batch.admit([spec])[0]

    def run(self, stop: Callable[[], bool]) -> list[tuple[int, SampleResult, dict[str, float]]]:
        """Decode until a request finishes, nothing is left, or ``stop()`` says to yield; the finished requests
        with their timings (``load_weights``, ``prefill``, ``decode``)."""
        self.batch.model = self._activate()
        self.batch.run(lambda: self.batch.has_finished or stop())
        return [(done.handle, result_of(done), {"load_weights": self.load_weights_s, "prefill": done.prefill_s,
                                                 "decode": done.decode_s})
                for done in self.batch.take_finished()]

