"""``Usage``: the observer of every model queue (engine/queue.py ``QueueObserver``). It counts what each job cost
once, where its result is known, and hands it to the metrics, the console's activity, the traces and the token
budgets.

Tokens, per tenant: ``train``: the datum tokens of a ``forward_backward`` that ran; ``prefill``: a ``forward``'s
datum tokens, and a sample request's prompt (once per request, however many samples); ``generation``: the tokens
a sample request returned. A sample was charged its prompt plus ``num_samples x max_tokens`` when accepted; what it
did not use goes back to its key's budget here, and a job that failed gives back all it was charged. Everything
here runs on a model thread and must not raise into the queue: a failure is logged once and the job goes on.
"""

from __future__ import annotations

import logging
import threading
import time

from server_mock.engine.jobs import Job
from server_mock.engine.requests import approx_bytes
from server_mock.service.activity import Activity, Running
from server_mock.service.metrics import Metrics, op_label, tenant_label
from server_mock.service.rate_limits import TokenBudgets
from server_mock.service.traces import OpRecord, TraceBook

logger = logging.getLogger("server_mock")
FORWARD_KINDS = ("forward", "forward_backward")


def rows_of(job: Job) -> int:
    """Rows a queued job puts in its batch: a sample request's ``num_samples`` (its payload is a tuple that
    starts with its SampleSpec, service/samplers.py), else 1."""
    payload = job.payload
    if isinstance(payload, tuple) and payload:
        return int(getattr(payload[0], "num_samples", 1) or 1)
    return 1


def adapters_of(jobs: list[Job]) -> int:
    """The distinct sets of weights of jobs that run together: a sample job's ``weights_key`` (other jobs: each
    batch key, else each run or request, is one)."""
    return len({job.weights_key or job.batch_key or job.scope or job.request_id for job in jobs})


class Usage:
    def __init__(self, budgets: TokenBudgets | None = None) -> None:
        self.metrics = Metrics()
        self.activity = Activity()
        self.traces = TraceBook()
        self.budgets = budgets or TokenBudgets()
        self.budgets.on_limited = lambda tenant: self.metrics.rate_limited.labels(tenant_label(tenant)).inc()
        self._computed: dict[str, tuple[float, int]] = {}  # request id -> (when its work returned, its rows)
        self._lock = threading.Lock()
        self._failed_once = False

    # --- QueueObserver ------------------------------------------------------------------------------------

    def started(self, jobs: list[Job]) -> None:
        try:
            for job in jobs:
                self.metrics.queue_wait.labels(op_label(job.kind)).observe(max(0.0, (job.started or 0) - job.created))
            if all(job.batch_key is None for job in jobs):  # sample jobs: ``batch`` lists them with their batch
                self._running(jobs)
        except Exception as exc:  # noqa: BLE001 - observing must never fail a job
            self._failed(exc)

    def batch(self, jobs: list[Job]) -> None:
        try:
            if jobs:
                running = self._running(jobs)
                self.metrics.batch_rows.observe(running.rows)
                self.metrics.batch_adapters.observe(running.adapters)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def computed(self, job: Job, result: dict) -> None:
        try:
            rows = 1
            tenant = tenant_label(job.owner)
            if job.kind in FORWARD_KINDS:
                rows = len(result.get("loss_fn_outputs") or ())
                self.metrics.batch_rows.observe(rows)
                self._count(tenant, "train" if job.kind == "forward_backward" else "prefill", job.tokens)
            elif job.kind == "sample":
                prompt, generated = int(result.get("input_tokens", 0)), int(result.get("output_tokens", 0))
                rows = len(result.get("sequences") or ())
                self._count(tenant, "prefill", prompt)
                self._count(tenant, "generation", generated)
                used = prompt + generated
                if job.tokens > used:  # the reservation's unused part goes back
                    self.budgets.give_back(job.owner, job.tokens - used)
                    job.tokens = used
            with self._lock:
                self._computed[job.request_id] = (time.monotonic(), rows)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def finished(self, job: Job) -> None:
        try:
            with self._lock:
                computed, rows = self._computed.pop(job.request_id, (None, 0))
            started = job.started if job.started is not None else job.finished
            self.metrics.op_duration.labels(op_label(job.kind)).observe(max(0.0, job.finished - started))
            code = None
            if job.status == "failed":
                code = job.error.code if job.error is not None else "internal_error"
                self.budgets.give_back(job.owner, job.tokens)
                self.metrics.errors.labels(tenant_label(job.owner), code).inc()
                if job.error is not None:
                    self.activity.error(tenant_label(job.owner), job.kind, job.error.status, code, job.error.message)
            self.activity.job_done(threading.current_thread().name, job.request_id)
            if job.scope:
                self.activity.op_finished(job.scope, job.kind, job.status)
                self.traces.add(OpRecord(job.request_id, job.kind, job.scope, tenant_label(job.owner), job.created,
                                         started, computed if computed is not None else job.finished, job.finished,
                                         job.status, code, job.tokens, rows, approx_bytes(job.result)))
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    # --- from the endpoints ---------------------------------------------------------------------------------

    def refused(self, tenant: str, route: str, status: int, code: str, message: str) -> None:
        """A request answered with an error before it queued anything (a 4xx of the worker's checks, a 429)."""
        self.metrics.errors.labels(tenant_label(tenant), code).inc()
        self.activity.error(tenant_label(tenant), route, status, code, message)

    # --- inside ---------------------------------------------------------------------------------------------

    def _count(self, tenant: str, kind: str, tokens: int) -> None:
        if tokens <= 0:
            return
        {"train": self.metrics.train_tokens, "prefill": self.metrics.prefill_tokens,
         "generation": self.metrics.generation_tokens}[kind].labels(tenant).inc(tokens)
        self.activity.tokens(tenant, kind, tokens)

    def _running(self, jobs: list[Job]) -> Running:
        """What this model thread runs now (the console's "running batch"; one entry per model thread)."""
        running = Running(
            kind=jobs[0].kind, rows=sum(rows_of(job) for job in jobs),
            adapters=adapters_of(jobs),
            tenants=sorted({tenant_label(job.owner) for job in jobs}), tokens=sum(job.tokens for job in jobs),
            since=time.time(), open={job.request_id for job in jobs})
        self.activity.running(threading.current_thread().name, running)
        return running

    def _failed(self, exc: Exception) -> None:
        if not self._failed_once:
            self._failed_once = True
            logger.exception("observing the model queue failed (metrics may be incomplete): %s", exc)
