"""Training runs and their ops."""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route

from pytrio_compat.wire import CreateTrainingRun, TrainingOp
from server_mock.api.native.endpoint import endpoint, service_of


async def create_run(request: Request, tenant: str, body: CreateTrainingRun):
    service = service_of(request)
    return await request.app.state.idempotency.remember(request, tenant,
                                                        lambda: service.create_training_run(body, tenant))


async def get_run(request: Request, tenant: str):
    service = service_of(request)
    return service._run_info(service.get_run(request.path_params["run_id"], tenant))


async def delete_run(request: Request, tenant: str):
    await service_of(request).delete_run(request.path_params["run_id"], tenant)
    return {"deleted": True}


async def submit_op(request: Request, tenant: str, body: TrainingOp):
    # a forward op's tensors are hashed and decoded in a worker thread, not on the event loop
    return await service_of(request).submit_op_off_loop(request.path_params["run_id"], body, tenant)


ROUTES = [
    Route("/v1/training_runs", endpoint(create_run, CreateTrainingRun), methods=["POST"]),
    Route("/v1/training_runs/{run_id}", endpoint(get_run), methods=["GET"]),
    Route("/v1/training_runs/{run_id}", endpoint(delete_run), methods=["DELETE"]),
    Route("/v1/training_runs/{run_id}/ops", endpoint(submit_op, TrainingOp), methods=["POST"]),
]
