"""``SamplingSession``: one running decode batch of an in-process model, resumable between the queue's turns.

The model queue (engine/queue.py) opens a session for sample requests that share weights, adds requests to it
while it decodes (continuous admission) and runs it in slices, so that other tenants' work runs in between. A
slice may follow a training op or another sampler's slice on the same model, so each call first puts the
session's weights back (``LocalModelHost.sampling_model``: the sampler slot is reloaded only if another snapshot
took it meanwhile). The decoding itself is ``sampling.decode_batch.DecodeBatch``: a request gets the same tokens
and logprobs whether it ran alone, joined a running batch or was decoded across many slices.

A session can also take requests for other adapters of the same base model (``add`` with their snapshot, where
``can_mix``): from the first such request on, the batch decodes on a ``MixedLoraDecoder`` (engine/mixed_lora.py),
each row with its own adapter. Until then a session of one adapter decodes on the merged copy of its weights,
which is faster for a batch of one adapter (docs/benchmarks.md); with ``--batch-invariant`` every session decodes
on the mixed path, whose per-request matmuls make a request's results the same bits alone or in any batch.
"""

from __future__ import annotations

import time
import collections
from typing import Callable

from server_mock.engine.merged_lora import MergedDecoder
from server_mock.engine.mixed_lora import MixedLoraDecoder
from server_mock.lora import Snapshot
from server_mock.sampling.decode_batch import DecodeBatch
from server_mock.sampling.generate import SampleResult, check_spec, result_of

__all__ = ["SamplingSession", "weights_tag"]

_SAME = object()


def weights_tag(snapshot: Snapshot | None) -> str:
    """The key a batch knows a snapshot's rows by ("base" for the base model)."""
    return "base" if snapshot is None else f"snapshot:{snapshot.snapshot_id}"


class SamplingSession:
    """A ``DecodeBatch`` for one set of weights (a snapshot, or None for the base model) on a local host."""

    def __init__(self, host, snapshot: Snapshot | None) -> None:
        self.host, self.snapshot = host, snapshot
        started = time.perf_counter()
        self.mixed: MixedLoraDecoder | None = None
        self._open: collections.Counter[str] = collections.Counter()  # open requests by weights tag
        self._tags: dict[int, str] = {}  # request handle -> its weights tag
        if getattr(host, "batch_invariant", False) and host.can_mix:
            self.mixed = host.mixed_decoder()
            self.model = self.mixed
        else:
            # kept while the batch holds one adapter, so its requests decode on the same model (merged or not)
            self.model = host.decode_model(snapshot)
        self.merged = isinstance(self.model, MergedDecoder)
        self.load_weights_s = time.perf_counter() - started
        self.batch = DecodeBatch(self.model, host.tokenizer, host.sampling_support,
                                 profile=getattr(host, "decode_profile", None),
                                 static=None if self.mixed else host.static_steps(self.model), vision=host.vision,
                                 prefix_store=getattr(host, "prefix_store", None))
        self.requests = 0  # requests added so far (the batch_requests metric)

    @property
    def can_mix(self) -> bool:
        """Whether requests for other adapters of this base model can join this batch."""
        return bool(getattr(self.host, "can_mix", False))

    def _activate(self):
        """The session's model, its weights back in place if other work ran since the last slice (a merged
        decoder holds its own weights; the PEFT slot may have been reloaded with another snapshot)."""
        if self.merged or self.mixed is not None:
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

    def add(self, spec, snapshot=_SAME) -> int:
        """Prefill a request into the batch (it decodes with the next ``run``); its handle. ``snapshot``: its
        weights, where they may differ from the session's (``can_mix``)."""
        return self.add_many([spec], snapshot)[0]

    def add_many(self, specs: list, snapshot=_SAME) -> list[int]:
        """Prefill requests for the same weights into the batch together: one prefill of their prompts (of what
        follows a stored prefix, where they share one) and one stack under the running batch, where one by one
        each would read the weights again. Their handles; a failure admits none of them."""
        for spec in specs:
            check_spec(spec, self.host.tokenizer)
        snapshot = self.snapshot if snapshot is _SAME else snapshot
        tag = weights_tag(snapshot)
        if self.mixed is None and tag != weights_tag(self.snapshot):
            if not self.can_mix:
                raise ValueError("this decode batch takes requests for its own weights only")
            self._go_mixed()
        if self.mixed is not None:
            self.mixed.join(tag, snapshot, len(specs))
        self.batch.model = self._activate()
        try:
            handles = self.batch.admit(list(specs), tag=tag)
        except BaseException:
            if self.mixed is not None:
                for _ in specs:
                    self.mixed.leave(tag)
            raise
        self.requests += len(handles)
        self._open[tag] += len(handles)
        for handle in handles:
            self._tags[handle] = tag
        return handles

    def _go_mixed(self) -> None:
        """From now on decode every row with its own adapter (the open requests keep their weights)."""
        started = time.perf_counter()
        self.mixed = self.host.mixed_decoder()
        for tag, count in self._open.items():
            if count > 0:
                self.mixed.join(tag, self.snapshot, count)
        self.model = self.mixed
        self.merged = False
        self.batch.use_model(self.mixed)
        self.load_weights_s += time.perf_counter() - started

    def _left(self, handle: int) -> None:
        tag = self._tags.pop(handle)
        self._open[tag] -= 1
        if self.mixed is not None:
            self.mixed.leave(tag)

    def run(self, stop: Callable[[], bool]) -> list[tuple[int, SampleResult, dict[str, float]]]:
        """Decode until a request finishes, nothing is left, or ``stop()`` says to yield; the finished requests
        with their timings (``load_weights``, ``prefill``, ``decode``)."""
        self.batch.model = self._activate()
        self.batch.run(lambda: self.batch.has_finished or stop())
        finished = self.batch.take_finished()
        for done in finished:
            self._left(done.handle)
        return [(done.handle, result_of(done), {"load_weights": self.load_weights_s, "prefill": done.prefill_s,
                                                 "decode": done.decode_s})
                for done in finished]

