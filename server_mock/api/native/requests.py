"""Requests: status and result, by long poll."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytrio_compat.wire import ErrorBody, RequestStatus
from server_mock.api.long_polls import held_poll
from server_mock.api.native.endpoint import endpoint, poll_seconds, service_of, wait_unless_disconnected
from server_mock.engine.jobs import Job
from server_mock.errors import WorkerError


def request_status(job: Job, queue_position: int | None = None) -> RequestStatus:
    now = time.monotonic()
    queued = (job.started if job.started is not None else now) - job.created
    ran = None if job.started is None else (job.finished if job.finished is not None else now) - job.started
    error = None if job.error is None else ErrorBody(code=job.error.code, message=job.error.message,
                                                     field=job.error.field)
    return RequestStatus(request_id=job.request_id, status=job.status, result=job.result, error=error,
                         queue_position=queue_position, kind=job.kind, queue_seconds=round(queued, 6),
                         run_seconds=None if ran is None else round(ran, 6))


async def get_request(request: Request, tenant: str):
    service = service_of(request)
    wait = poll_seconds(request)
    request_id = request.path_params["request_id"]
    job = service.requests.get(request_id, tenant)
    if job is None:
        raise WorkerError(404, "request_not_found",
                          f"unknown request {request_id} ({service.requests.why_gone(request_id, tenant)})")
    waiting = service.requests.wait(job, wait)
    if wait > 0:  # a long poll: one of the tenant's few held at once (api/long_polls.py)
        waiting = held_poll(request, tenant, waiting)
    if not await wait_unless_disconnected(request, waiting):
        return Response(status_code=499)  # the poller went away; the request itself runs on regardless
    return request_status(job, service.models.queue_position(job.request_id) if job.status == "queued" else None)


ROUTES = [
    Route("/v1/requests/{request_id}", endpoint(get_request), methods=["GET"]),
]
