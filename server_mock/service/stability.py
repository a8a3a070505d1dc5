"""Stability records: what the worker keeps about each sampled sequence when a sampling client asks for it
(Tinker's ``record_stability_info``), and the resolution of a datum's provenance spans against them, which
gives the ``stable_reinforce`` loss its sampler logprobs (training/losses.py).

A record holds the sampling request's prompt (one copy shared by the request's sequences), the sequence's
sampled tokens and their logprobs exactly as the sampler returned them, its sampler, and a scope (the
front end's session): a training request may name only sequences of its own API key and scope. The loss
reads the recorded logprobs, never the client's copy of them, and every claim a span makes about tokens is
checked against the record.

Bounds, per API key: ``max_recorded_sequences`` and ``max_recorded_tokens`` (a request's prompt counts once),
least recently used dropped first; a record unused for ``recorded_sequence_ttl`` seconds is dropped (sampling
it and training on it both count as use). Records go with their sampler (when the service drops it) and with
their scope (a finished session), and do not survive a restart: a datum naming one that is gone fails with a
message saying so.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from server_mock.config import Limits
from server_mock.errors import bad_request
from server_mock.training import losses

KINDS = ("prompt", "sampled")


@dataclass(frozen=True)
class Span:
    """A run of consecutive datum positions that claims to be positions [offset, offset + length) of a sampled
    sequence's prompt (``prompt``) or of its sampled tokens (``sampled``)."""

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass
class _Prompt:
    tokens: np.ndarray  # int64
    holders: int = 0  # records that share it


@dataclass
class _Record:
    tenant: str
    scope: str
    sampler_id: str
    prompt: _Prompt
    tokens: np.ndarray  # int64 [S]
    logprobs: np.ndarray  # float32 [S]
    last_used: float


GONE = ("is not held by this worker: it was not sampled with record_stability_info=True by this API key, or it "
        "was dropped (unused for {ttl:g} s, the least recently used past {count} sequences or {tokens} tokens "
        "per API key, its sampling client or session ended, or the worker restarted); sample again")


class StabilityRecords:
    """The records of every API key; thread-safe (sampling results are recorded and training requests resolved
    in worker threads)."""

    def __init__(self, limits: Limits, clock=time.time) -> None:
        self.limits = limits
        self.clock = clock
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OrderedDict[str, _Record]] = {}
        self._tokens: dict[str, int] = {}
        self._by_sampler: dict[str, set[tuple[str, str]]] = {}

    # --- recording ---------------------------------------------------------------------------------------

    def record(self, tenant: str, scope: str, sampler_id: str, prompt_tokens: Sequence[int],
               sequences: Sequence[tuple[str, Sequence[int], Sequence[float]]]) -> None:
        """Keep one sampling request's sequences: (sequence id, sampled tokens, their logprobs) each."""
        prompt = _Prompt(np.asarray(prompt_tokens, dtype=np.int64))
        now = self.clock()
        with self._lock:
            entries = self._by_tenant.setdefault(tenant, OrderedDict())
            self._drop_expired(tenant, now)
            for sequence_id, tokens, logprobs in sequences:
                self._pop(tenant, sequence_id)
                record = _Record(tenant, scope, sampler_id, prompt, np.asarray(tokens, dtype=np.int64),
                                 np.asarray(logprobs, dtype=np.float32), now)
                if prompt.holders == 0:
                    self._tokens[tenant] = self._tokens.get(tenant, 0) + len(prompt.tokens)
                prompt.holders += 1
                self._tokens[tenant] = self._tokens.get(tenant, 0) + len(record.tokens)
                entries[sequence_id] = record
                self._by_sampler.setdefault(sampler_id, set()).add((tenant, sequence_id))
            while entries and (len(entries) > self.limits.max_recorded_sequences
                               or self._tokens.get(tenant, 0) > self.limits.max_recorded_tokens):
                self._pop(tenant, next(iter(entries)))

    def held(self, tenant: str) -> tuple[int, int]:
        """(sequences, tokens) held for this API key."""
        with self._lock:
            self._drop_expired(tenant, self.clock())
            return len(self._by_tenant.get(tenant, ())), self._tokens.get(tenant, 0)

    def drop_sampler(self, sampler_id: str) -> None:
        with self._lock:
            for tenant, sequence_id in list(self._by_sampler.get(sampler_id, ())):
                self._pop(tenant, sequence_id)
            self._by_sampler.pop(sampler_id, None)

    def drop_scope(self, tenant: str, scope: str) -> None:
        with self._lock:
            entries = self._by_tenant.get(tenant, {})
            for sequence_id in [s for s, r in entries.items() if r.scope == scope]:
                self._pop(tenant, sequence_id)

    def _pop(self, tenant: str, sequence_id: str) -> None:
        record = self._by_tenant.get(tenant, {}).pop(sequence_id, None)
        if record is None:
            return
        record.prompt.holders -= 1
        freed = len(record.tokens) + (len(record.prompt.tokens) if record.prompt.holders == 0 else 0)
        self._tokens[tenant] -= freed
        holders = self._by_sampler.get(record.sampler_id)
        if holders is not None:
            holders.discard((tenant, sequence_id))
            if not holders:
                del self._by_sampler[record.sampler_id]

    def _drop_expired(self, tenant: str, now: float) -> None:
        entries = self._by_tenant.get(tenant)
        cutoff = now - self.limits.recorded_sequence_ttl
        while entries and next(iter(entries.values())).last_used < cutoff:  # least recently used first
            self._pop(tenant, next(iter(entries)))

    # --- resolving a datum's provenance ------------------------------------------------------------------

    def resolve(self, tenant: str, scope: str, where: str, tokens: np.ndarray, targets: np.ndarray,
                advantages: np.ndarray, model_input_spans: Sequence[Span] | None,
                loss_spans: Sequence[Span] | None) -> tuple[np.ndarray, np.ndarray]:
        """A stable_reinforce datum's ``recorded_logprobs`` and ``recorded_mask`` (float32 [N]): the recorded
        sampler logprob at each position its loss spans attribute to a sampled token, 1 there, 0 elsewhere.

        Checked (a 400 naming the field otherwise): both span lists present and tiling their fields; every named
        sequence held for this API key and scope; every span inside its sequence; the model input and the
        sampled targets equal to the recorded tokens they claim to be (targets at prompt positions are not
        checked: recipes put 0 there); advantages 0 off the sampled positions. Marks the records used."""
        if model_input_spans is None or loss_spans is None:
            raise bad_request(f"{where}.loss_fn_input_spans", "stable_reinforce needs provenance on every datum: "
                              "name the sampled sequence behind each position (Datum.with_provenance, with the "
                              "sequence_id of each SampledSequence)")
        n = len(targets)
        mu = np.zeros(n, dtype=np.float32)
        sampled = np.zeros(n, dtype=np.float32)
        now = self.clock()
        with self._lock:
            self._drop_expired(tenant, now)
            used: dict[str, _Record] = {}
            self._walk(tenant, scope, f"{where}.model_input_spans", model_input_spans, len(tokens), used,
                       lambda pos, rec, span: self._check_tokens(tokens, pos, rec, span,
                                                                 f"{where}.model_input_spans", "model_input"))

            def attribute(pos: int, rec: _Record, span: Span) -> None:
                if span.kind != "sampled":
                    return
                stop = pos + span.length
                live = targets[pos:stop] != losses.IGNORE_INDEX
                claimed = rec.tokens[span.offset:span.offset + span.length]
                if not np.array_equal(targets[pos:stop][live], claimed[live]):
                    bad = pos + int(np.flatnonzero(live & (targets[pos:stop] != claimed))[0])
                    raise bad_request(f"{where}.loss_fn_inputs.target_tokens",
                                      f"position {bad} is {int(targets[bad])}, but its span names token "
                                      f"{int(rec.tokens[span.offset + bad - pos])} of sampled sequence "
                                      f"{span.sequence_id!r}")
                mu[pos:stop] = rec.logprobs[span.offset:span.offset + span.length]
                sampled[pos:stop] = 1.0

            self._walk(tenant, scope, f"{where}.loss_fn_input_spans", loss_spans, n, used, attribute)
            for sequence_id, record in used.items():
                record.last_used = now
                self._by_tenant[tenant].move_to_end(sequence_id)
        stray = (sampled == 0) & (targets != losses.IGNORE_INDEX) & (advantages != 0)
        if stray.any():
            pos = int(np.flatnonzero(stray)[0])
            raise bad_request(f"{where}.loss_fn_inputs.advantages",
                              f"stable_reinforce only accepts nonzero advantages on sampled tokens; position {pos} "
                              f"({advantages[pos]:g}) is not attributed to a sampled token by loss_fn_input_spans")
        return mu, sampled

    def _walk(self, tenant: str, scope: str, field: str, spans: Sequence[Span], size: int,
              used: dict[str, _Record], visit) -> None:
        if sum(span.length for span in spans) != size:
            raise bad_request(field, f"the spans' lengths must add up to {size}, the length of the field they "
                                     f"annotate, got {sum(span.length for span in spans)}")
        pos = 0
        for j, span in enumerate(spans):
            record = self._record(tenant, scope, span.sequence_id, f"{field}[{j}].sequence_id")
            have = len(record.tokens) if span.kind == "sampled" else len(record.prompt.tokens)
            if span.offset + span.length > have:
                raise bad_request(f"{field}[{j}]", f"offset {span.offset} + length {span.length} runs past the "
                                                   f"{have} {span.kind} tokens of sequence {span.sequence_id!r}")
            visit(pos, record, span)
            used[span.sequence_id] = record
            pos += span.length

    def _record(self, tenant: str, scope: str, sequence_id: str, field: str) -> _Record:
        record = self._by_tenant.get(tenant, {}).get(sequence_id)
        if record is None:
            limits = self.limits
            raise bad_request(field, f"sequence {sequence_id!r} " + GONE.format(
                ttl=limits.recorded_sequence_ttl, count=limits.max_recorded_sequences,
                tokens=limits.max_recorded_tokens), code="unknown_sequence")
        if record.scope != scope:
            raise bad_request(field, f"sequence {sequence_id!r} was sampled in another session; a training "
                                     "request may name only sequences sampled in its own session",
                              code="unknown_sequence")
        return record

    @staticmethod
    def _check_tokens(tokens: np.ndarray, pos: int, record: _Record, span: Span, field: str, what: str) -> None:
        source = record.tokens if span.kind == "sampled" else record.prompt.tokens
        claimed = source[span.offset:span.offset + span.length]
        actual = tokens[pos:pos + span.length]
        if not np.array_equal(actual, claimed):
            bad = int(np.flatnonzero(actual != claimed)[0])
            raise bad_request(field, f"{what} position {pos + bad} is {int(actual[bad])}, but its span names "
                                     f"token {int(claimed[bad])} ({span.kind} token {span.offset + bad} of "
                                     f"sequence {span.sequence_id!r})")
