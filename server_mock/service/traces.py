"""The last ops of each run and sampler, as a Chrome / Perfetto trace (docs/operations.md, "Traces").

Every finished job with a scope (the run or sampler it is for, ``Job.scope``) leaves one record in its scope's ring
(the newest ``per_scope``; at most ``max_scopes`` scopes, the least recently written dropped first). ``trace`` turns
the records of some scopes into the Trace Event Format's JSON object form: ``{"traceEvents": [...],
"displayTimeUnit": "ms"}``, each op a complete event (``ph: "X"``, ``ts`` and ``dur`` in microseconds, ``pid``,
``tid``, ``name``, ``cat``, ``args``) with its three phases nested inside it: ``queue`` (accepted to taken by the
model), ``run`` (the work) and ``encode`` (the result put in its protocol's wire form, and recorded), then metadata
events (``ph: "M"``) naming the process and the tracks. Ops that overlap in time (one queued while another runs) go on
different tracks (``tid``), so that the slices on one track always nest, as trace viewers require.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PER_SCOPE = 256
MAX_SCOPES = 4096
SessionScopes = Callable[[str], "list[str] | None"]  # a front end's session id -> its runs' and samplers' ids


@dataclass(frozen=True)
class OpRecord:
    request_id: str
    kind: str
    scope: str
    tenant: str
    created: float  # monotonic seconds
    started: float
    computed: float
    finished: float
    status: str
    code: str | None
    tokens: int  # what the op held of its key's budget: datum tokens, or a sample's prompt + returned tokens
    rows: int
    result_bytes: int


class TraceBook:
    def __init__(self, per_scope: int = PER_SCOPE, max_scopes: int = MAX_SCOPES) -> None:
        self.per_scope, self.max_scopes = per_scope, max_scopes
        self._rings: collections.OrderedDict[str, collections.deque[OpRecord]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._wall_offset = time.time() - time.monotonic()  # trace timestamps are wall-clock microseconds
        self.sessions: list[SessionScopes] = []  # front ends add theirs: session id -> its scopes (None: not theirs)

    def add(self, record: OpRecord) -> None:
        with self._lock:
            ring = self._rings.get(record.scope)
            if ring is None:
                ring = self._rings[record.scope] = collections.deque(maxlen=self.per_scope)
                while len(self._rings) > self.max_scopes:
                    self._rings.popitem(last=False)
            else:
                self._rings.move_to_end(record.scope)
            ring.append(record)

    def records(self, scopes: Iterable[str]) -> list[OpRecord]:
        with self._lock:
            out = [r for scope in scopes for r in self._rings.get(scope, ())]
        return sorted(out, key=lambda r: (r.created, r.request_id))

    def session_scopes(self, session_id: str) -> list[str] | None:
        """The scopes of a front end's session (None: no front end knows it)."""
        for resolve in self.sessions:
            scopes = resolve(session_id)
            if scopes is not None:
                return scopes
        return None

    def trace(self, records: list[OpRecord], title: str) -> dict:
        """The Trace Event Format JSON object of ``records`` (oldest first)."""
        events: list[dict] = []
        track_ends: list[float] = []  # per track, when its last op finished
        for r in records:
            track = next((i for i, end in enumerate(track_ends) if end <= r.created), len(track_ends))
            if track == len(track_ends):
                track_ends.append(r.finished)
            else:
                track_ends[track] = r.finished
            tid = track + 1
            args = {"request_id": r.request_id, "scope": r.scope, "tenant": r.tenant, "status": r.status,
                    "tokens": r.tokens, "rows": r.rows, "result_bytes": r.result_bytes}
            if r.code:
                args["error_code"] = r.code
            events.append(self._span(r.kind, "op", r.created, r.finished, tid, args))
            events.append(self._span("queue", "queue", r.created, r.started, tid, {"request_id": r.request_id}))
            events.append(self._span("run", "run", r.started, r.computed, tid,
                                     {"request_id": r.request_id, "tokens": r.tokens, "rows": r.rows}))
            events.append(self._span("encode", "encode", r.computed, r.finished, tid,
                                     {"request_id": r.request_id, "result_bytes": r.result_bytes}))
        events.append({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": title}})
        for track in range(len(track_ends)):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": track + 1,
                           "args": {"name": f"ops {track + 1}"}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def _span(self, name: str, cat: str, start: float, end: float, tid: int, args: dict) -> dict:
        ts = round((start + self._wall_offset) * 1e6)
        return {"name": name, "cat": cat, "ph": "X", "ts": ts,
                "dur": max(0, round((end + self._wall_offset) * 1e6) - ts), "pid": 1, "tid": tid, "args": args}
