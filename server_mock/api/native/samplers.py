"""Samplers and their sample requests."""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route

from pytrio_compat.wire import CreateSampler, SampleRequest
from server_mock.api.native.endpoint import endpoint, service_of


async def create_sampler(request: Request, tenant: str, body: CreateSampler):
    service = service_of(request)
    return await request.app.state.idempotency.remember(request, tenant, lambda: service.create_sampler(body, tenant))


async def get_sampler(request: Request, tenant: str):
    sampler = service_of(request).get_sampler(request.path_params["sampler_id"], tenant)
    return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}


async def sample(request: Request, tenant: str, body: SampleRequest):
    return service_of(request).submit_sample(request.path_params["sampler_id"], body, tenant)


ROUTES = [
    Route("/v1/samplers", endpoint(create_sampler, CreateSampler), methods=["POST"]),
    Route("/v1/samplers/{sampler_id}", endpoint(get_sampler), methods=["GET"]),
    Route("/v1/samplers/{sampler_id}/sample", endpoint(sample, SampleRequest), methods=["POST"]),
]
