"""Samplers and their sample requests."""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route

from pytrio_compat.wire import Accepted, CreateSampler, SampleRequest, SamplerInfo
from server_mock.api.native.endpoint import endpoint, service_of


async def create_sampler(request: Request, tenant: str, body: CreateSampler):
    service = service_of(request)

    async def create() -> SamplerInfo:
        sampler = await service.samplers.create(body, tenant)
        return SamplerInfo(sampler_id=sampler.sampler_id, base_model=sampler.base_model, model_path=body.model_path)

    return await request.app.state.idempotency.remember(request, tenant, create)


async def get_sampler(request: Request, tenant: str):
    sampler = service_of(request).samplers.get(request.path_params["sampler_id"], tenant)
    return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}


async def sample(request: Request, tenant: str, body: SampleRequest):
    job = await service_of(request).samplers.submit_async(request.path_params["sampler_id"], body, tenant)
    return Accepted(request_id=job.request_id)


ROUTES = [
    Route("/v1/samplers", endpoint(create_sampler, CreateSampler), methods=["POST"]),
    Route("/v1/samplers/{sampler_id}", endpoint(get_sampler), methods=["GET"]),
    Route("/v1/samplers/{sampler_id}/sample", endpoint(sample, SampleRequest), methods=["POST"]),
]
