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

    def __init__(self, host, snapshot: Snapshot | None, defer: bool = False) -> None:
        """``defer``: choose the model at the first ``add``/``add_many`` (a batch whose first requests are of
        several adapters then starts on the mixed decoder and never builds the merged copy of the first one's)."""
        self.host, self.snapshot = host, snapshot
        self.mixed: MixedLoraDecoder | None = None
        self._open: collections.Counter[str] = collections.Counter()  # open requests by weights tag
        self._tags: dict[int, str] = {}  # request handle -> its weights tag
        self._load_s: dict[int, float] = {}  # request handle -> seconds spent putting weights in place for it
        self._pending_load_s = 0.0  # weights put in place before the first request (its share when it comes)
        self.load_weights_s = 0.0  # all of it, for the session
        self.model = None
        self.merged = False
        self.batch = DecodeBatch(host.model, host.tokenizer, host.sampling_support,
                                 profile=getattr(host, "decode_profile", None), static=None, vision=host.vision,
                                 prefix_store=getattr(host, "prefix_store", None))
        if not defer:
            self._choose_model(mixed=False)
        self.requests = 0  # requests added so far (the batch_requests metric)

    def _choose_model(self, mixed: bool) -> None:
        """The model the batch decodes on: the mixed decoder (``mixed``, or always with ``--batch-invariant``),
        else, while the batch holds one adapter, its merged copy (or the sampler slot)."""
        started = time.perf_counter()
        host = self.host
        if (mixed or getattr(host, "batch_invariant", False)) and host.can_mix:
            self.mixed = host.mixed_decoder()
            self.model = self.mixed
        else:
            # kept while the batch holds one adapter, so its requests decode on the same model (merged or not)
            self.model = host.decode_model(self.snapshot)
        self.merged = isinstance(self.model, MergedDecoder)
        self.batch.model = self.model
        self.batch.static = None if self.mixed else host.static_steps(self.model)
        self._loaded(time.perf_counter() - started)

    def _loaded(self, seconds: float, handles=None) -> None:
        """``seconds`` of weight loading, charged to ``handles`` (None: every open request, or the first to come)."""
        self.load_weights_s += seconds
        if handles is None:
            handles = list(self._tags)
            if not handles:
                self._pending_load_s += seconds
                return
        for handle in handles:
            self._load_s[handle] = self._load_s.get(handle, 0.0) + seconds

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
        self._loaded(time.perf_counter() - started)
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
        return self.add_many([(spec, self.snapshot if snapshot is _SAME else snapshot)])[0]

    def add_many(self, requests: list) -> list[int]:
        """Prefill ``(spec, snapshot)`` requests into the batch together (one prefill where the batch can take
        them); their handles. If one fails, none was added."""
        for spec, _ in requests:
            check_spec(spec, self.host.tokenizer)
        tags = [weights_tag(snapshot) for _, snapshot in requests]
        own = weights_tag(self.snapshot)
        others = any(tag != own for tag in tags)
        if others and not self.can_mix:
            raise ValueError("this decode batch takes requests for its own weights only")
        if self.model is None:
            self._choose_model(mixed=others)
        elif others and self.mixed is None:
            self._go_mixed()
        joined, load_s = [], []
        try:
            for tag, (_, snapshot) in zip(tags, requests):
                started = time.perf_counter()
                if self.mixed is not None:
                    self.mixed.join(tag, snapshot)
                    joined.append(tag)
                load_s.append(time.perf_counter() - started)
            self.batch.model = self._activate()
            handles = self.batch.admit([spec for spec, _ in requests], tags=tags)
        except BaseException:
            for tag in joined:
                self.mixed.leave(tag)
            raise
        share = self._pending_load_s / len(handles) if handles else 0.0
        self._pending_load_s = 0.0
        for handle, tag, seconds in zip(handles, tags, load_s):
            self.requests += 1
            self._open[tag] += 1
            self._tags[handle] = tag
            self._load_s[handle] = self._load_s.get(handle, 0.0) + seconds + share
            self.load_weights_s += seconds
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
        seconds = time.perf_counter() - started  # for the requests that join now (the open ones decode on)
        self.load_weights_s += seconds
        self._pending_load_s += seconds

    def _left(self, handle: int) -> None:
        tag = self._tags.pop(handle)
        self._load_s.pop(handle, None)
        self._open[tag] -= 1
        if self.mixed is not None:
            self.mixed.leave(tag)

    def run(self, stop: Callable[[], bool]) -> list[tuple[int, SampleResult, dict[str, float]]]:
        """Decode until a request finishes, nothing is left, or ``stop()`` says to yield; the finished requests
        with their timings (``load_weights``: the seconds spent putting weights in place for that request: its
        share of choosing the batch's model, its adapter's copy into a batch slot, and any reload of the session's
        weights while it was open; ``prefill``, ``decode``)."""
        if self.model is None:
            return []
        self.batch.model = self._activate()
        self.batch.run(lambda: self.batch.has_finished or stop())
        finished = self.batch.take_finished()
        out = []
        for done in finished:
            load_s = self._load_s.get(done.handle, 0.0)
            self._left(done.handle)
            out.append((done.handle, result_of(done), {"load_weights": load_s, "prefill": done.prefill_s,
                                                       "decode": done.decode_s}))
        return out

