"""Requests: status and result, by long poll."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server_mock.api.native.endpoint import endpoint, poll_seconds, service_of, wait_unless_disconnected
from server_mock.errors import WorkerError


async def get_request(request: Request, tenant: str):
    service = service_of(request)
    wait = poll_seconds(request)
    job = service.requests.get(request.path_params["request_id"], tenant)
    if job is None:
        raise WorkerError(404, "request_not_found",
                          f"unknown request {request.path_params['request_id']} (expired or worker restarted)")
    if not await wait_unless_disconnected(request, service.requests.wait(job, wait)):
        return Response(status_code=499)  # the poller went away; the request itself runs on regardless
    return job.to_status(service.queue_position(job.request_id) if job.status == "queued" else None)


ROUTES = [
    Route("/v1/requests/{request_id}", endpoint(get_request), methods=["GET"]),
]
