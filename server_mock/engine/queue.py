"""Jobs and their execution: the torch work for one base model runs on that model's own thread, tenants
served in turn, so the HTTP loop never blocks on torch. ``job_result`` is how every caller waits for a job.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from server_mock.errors import WorkerError, storage_error

logger = logging.getLogger("server_mock")


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
    # The submitter's conversion of the result to its wire form, run once on the model thread (None: as is).
    encode: Callable[[dict], dict] | None = None
    # Called on the event loop once the job has finished (the request store counts what its result holds).
    on_finish: Callable[[Job], None] | None = None
    # Called on the model's thread with the result or error before the job is marked finished (the durable
    # journal records it there, so a client never sees a finished request that a crash could lose); an
    # exception from it fails the job with that error instead.
    on_result: Callable[[Job, dict | None, WorkerError | None], None] | None = None


class ModelQueue:
    """The jobs for one base model, drained by one thread, tenants served in turn.

    Each tenant (job owner) has a FIFO lane; the thread takes one job from each waiting lane in turn,
    so a tenant with many queued requests delays another tenant's request by at most the one job that
    is running when it arrives. A run belongs to one tenant, so its ops keep their seq_id order.

    Sampling jobs for the same weights are coalesced: when one is taken, every queued job with its
    batch_key joins it (up to a token budget) and they decode as one batch. This is safe to reorder
    because a sampler reads an immutable snapshot, never the training state.
    """

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, batch_token_budget: int = 65536,
                 batch_window: float = 0.005) -> None:
        self.name = name
        self.loop = loop
        self.batch_token_budget = batch_token_budget
        self.batch_window = batch_window  # a short wait lets requests sent together arrive together
        self._lanes: collections.OrderedDict[str, collections.deque[Job]] = collections.OrderedDict()
        self._served: str | None = None  # the lane served last: it rejoins the rotation behind new arrivals
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"model-{name}", daemon=True)
        self._thread.start()

    def put(self, job: Job) -> None:
        with self._cond:
            lane = self._lanes.get(job.owner)
            if lane is None:
                lane = self._lanes[job.owner] = collections.deque()
            lane.append(job)
            self._cond.notify()

    def position(self, request_id: str) -> int | None:
        """How many queued jobs will be taken before this one (in turn order), None if not queued."""
        with self._cond:
            lanes = self._rotation()
            for index, lane in enumerate(lanes):
                for depth, job in enumerate(lane):
                    if job.request_id == request_id:
                        before = sum(min(len(other), depth) for other in lanes)
                        return before + sum(1 for other in lanes[:index] if len(other) > depth)
        return None

    def depth(self) -> int:
        with self._cond:
            return sum(len(lane) for lane in self._lanes.values())

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _rotation(self) -> list[collections.deque[Job]]:
        """The lanes in the order they will be served (the last-served one last)."""
        order = [lane for owner, lane in self._lanes.items() if owner != self._served and lane]
        if self._served in self._lanes and self._lanes[self._served]:
            order.append(self._lanes[self._served])
        return order

    def _pop_next(self) -> Job:
        if self._served is not None and self._served in self._lanes:
            self._lanes.move_to_end(self._served)  # behind every lane that waited meanwhile
        owner, lane = next(iter(self._lanes.items()))
        job = lane.popleft()
        if not lane:
            del self._lanes[owner]
        self._served = owner
        return job

    def _take(self) -> list[Job] | None:
        with self._cond:
            while not self._lanes and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            head = self._pop_next()
            if head.batch_key is None:
                return [head]
        if self.batch_window > 0:
            time.sleep(self.batch_window)
        with self._cond:
            group, budget = [head], self.batch_token_budget - head.batch_cost
            for owner in list(self._lanes):
                lane = self._lanes[owner]
                for job in list(lane):
                    if job.batch_key == head.batch_key and job.batch_cost <= budget:
                        group.append(job)
                        budget -= job.batch_cost
                        lane.remove(job)
                if not lane:
                    del self._lanes[owner]
            return group

    def _run(self) -> None:
        while True:
            group = self._take()
            if group is None:
                return
            now = time.monotonic()
            for job in group:
                job.status, job.started = "running", now
            if len(group) > 1:
                try:
                    results = group[0].batch_fn([job.payload for job in group])
                except Exception:  # noqa: BLE001 - one bad request must not fail its batch-mates
                    logger.warning("batched %s failed; running its %d jobs one by one", group[0].kind, len(group))
                else:
                    for job, result in zip(group, results):
                        self._finish(job, result=result)
                    continue
            for job in group:
                self._execute(job)

    def _execute(self, job: Job) -> None:
        try:
            result = job.fn()
            self._finish(job, result=job.encode(result) if job.encode is not None else result)
        except WorkerError as exc:
            self._finish(job, error=exc)
        except torch.OutOfMemoryError as exc:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._finish(job, error=WorkerError(500, "out_of_memory", f"out of memory while running {job.kind}: "
                                                f"{exc} (reduce the batch or sequence length)"))
        except Exception as exc:  # noqa: BLE001 - the error goes back to this request only
            logger.error("request %s (%s) failed:\n%s", job.request_id, job.kind, traceback.format_exc())
            self._finish(job, error=WorkerError(500, "internal_error", f"{job.kind} failed: "
                                                f"{type(exc).__name__}: {exc}"))

    def _finish(self, job: Job, result: dict | None = None, error: WorkerError | None = None) -> None:
        job.finished = time.monotonic()
        if result is not None and isinstance(result.get("metrics"), dict):
            # where the time went, per request: waiting for the model, then running on it
            result["metrics"]["time/queue"] = (job.started or job.finished) - job.created
            result["metrics"]["time/run"] = job.finished - (job.started or job.finished)
        if job.on_result is not None:
            try:
                job.on_result(job, result, error)
            except WorkerError as exc:
                result, error = None, exc
            except Exception as exc:  # noqa: BLE001 - the disk refused the result: this request fails, clearly
                logger.error("recording the result of %s (%s) failed: %s", job.request_id, job.kind, exc)
                result, error = None, storage_error(f"{job.kind} ran, but recording its result", exc)
        job.result, job.error = result, error
        job.status = "failed" if error is not None else "succeeded"
        job.fn, job.payload, job.batch_fn, job.encode = _done, None, None, None  # drop request tensors
        job.on_result = None
        if job.done is not None:
            self.loop.call_soon_threadsafe(_announce, job)


def _announce(job: Job) -> None:
    job.done.set()
    if job.on_finish is not None:
        job.on_finish(job)


def _done() -> dict:
    return {}


SERVER_ERROR_CODES = {"internal_error", "out_of_memory", "storage_full", "storage_failed"}


async def job_result(job: Job, convert: Callable[[dict], Any] | None = None) -> Any:
    """Wait for a job; its result through ``convert`` (which may be async), or its error as a WorkerError:
    500 for the worker's own failures (``SERVER_ERROR_CODES``), 400 for anything the request caused."""
    if job.done is not None:
        await job.done.wait()
    if job.status == "failed":
        err = job.error
        if err is None:
            raise WorkerError(500, "internal_error", f"{job.kind} failed")
        status = 500 if err.code in SERVER_ERROR_CODES else 507 if err.status == 507 else 400
        raise WorkerError(status, err.code, err.message, err.field)
    result = job.result or {}
    if convert is None:
        return result
    out = convert(result)
    if asyncio.iscoroutine(out):
        out = await out
    return out


