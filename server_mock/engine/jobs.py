"""Jobs: one request's work for a model's thread, its state as it runs, and how a caller waits for its result
(``job_result``); ``Decoding`` is what a sample job opens to decode in slices (engine/queue.py runs them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from server_mock.errors import WorkerError


@dataclass
class Job:
    request_id: str
    kind: str
    fn: Callable[[], dict]
    owner: str = ""
    status: str = "queued"
    result: dict | None = None
    error: WorkerError | None = None
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    done: asyncio.Event | None = None
    # Jobs with the same batch_key may run together: batch_fn maps their payloads to their results.
    batch_key: str | None = None
    payload: Any = None
    batch_fn: Callable[[list[Any]], list[dict]] | None = None
    batch_cost: int = 0
    # Jobs with the same mix_key may join a running decode batch of other weights, where that batch can hold rows
    # of several (``Decoding.mixes``): the same base model, and the same tenant unless tenants may share a batch.
    mix_key: str | None = None
    # The weights a sample job decodes with (service/samplers.py): a batch's distinct ones are the adapters it holds,
    # whether its jobs share a batch key (a host that mixes adapters per call) or not (a mixed decode session).
    weights_key: str | None = None
    # Where the host decodes in slices: opens a Decoding for this job's weights (None: batch_fn runs the batch).
    open_decode: Callable[[], "Decoding | None"] | None = None
    # The submitter's conversion of the result to its wire form, run once on the model thread (None: as is).
    encode: Callable[[dict], dict] | None = None
    # Called on the event loop once the job has finished (the request store counts what its result holds).
    on_finish: Callable[[Job], None] | None = None
    # Called on the model's thread with the result or error before the job is marked finished (the durable
    # journal records it there, so a client never sees a finished request that a crash could lose); an
    # exception from it fails the job with that error instead.
    on_result: Callable[[Job, dict | None, WorkerError | None], None] | None = None
    # What the service charged at admission and the run or sampler the job is for (service/usage.py reads them:
    # a forward op's datum tokens, a sample's prompt + num_samples x max_tokens; the scope of its trace).
    tokens: int = 0
    scope: str = ""
    # Where the work can pause between micro-batches: makes a generator that does the work, yielding the tokens
    # of each part it ran and returning the result (None: ``fn`` runs it in one go). The queue runs it in slices.
    open_steps: Callable[[], Iterator[int]] | None = None
    rows: int = 1  # rows of a sample request (num_samples): decode tokens per step, for the fair-share estimate
    charged: float = 0.0  # the cost charged to the owner so far (engine/fairness.py)


class Decoding(Protocol):
    """Sample jobs for the same weights decoding as one batch, in slices (service/samplers.py wraps an engine
    ``SamplingSession``). ``add`` prefills a job's request into the batch; ``run`` decodes until one finishes,
    nothing is left, or ``stop()`` (asked before every step) says to yield."""

    @property
    def active(self) -> bool: ...

    @property
    def mixes(self) -> bool:
        """Whether jobs for other weights (of the same ``mix_key``) can join this batch."""
        ...

    def can_add(self) -> bool: ...

    def add(self, payload: Any) -> int: ...

    def add_many(self, payloads: list[Any]) -> list[int]:
        """Prefill several jobs together (one prefill where ``add`` would make one each); all of them are added,
        or none and it raises. Optional: a decoding without it is given its jobs one by one."""
        ...

    def run(self, stop: Callable[[], bool]) -> list[tuple[int, dict]]: ...


SERVER_ERROR_CODES = {"internal_error", "out_of_memory", "storage_full", "storage_failed"}


async def job_result(job: Job, convert: Callable[[dict], Any] | None = None) -> Any:
    """Wait for a job; its result through ``convert`` (which may be async), or its error as a WorkerError:
    507 for a write under --storage the disk refused, 500 for the worker's other own failures
    (``SERVER_ERROR_CODES``), 400 for anything the request caused."""
    if job.done is not None:
        await job.done.wait()
    if job.status == "failed":
        err = job.error
        if err is None:
            raise WorkerError(500, "internal_error", f"{job.kind} failed")
        status = 507 if err.status == 507 else 500 if err.code in SERVER_ERROR_CODES else 400
        raise WorkerError(status, err.code, err.message, err.field)
    result = job.result or {}
    if convert is None:
        return result
    out = convert(result)
    if asyncio.iscoroutine(out):
        out = await out
    return out


