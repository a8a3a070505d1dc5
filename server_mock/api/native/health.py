"""Liveness, identity, capabilities and tokenizer files."""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route

from pytrio_compat.wire import GetServerCapabilitiesResponse, TokenizerFiles
from server_mock.api.native.endpoint import endpoint, service_of
from server_mock.errors import WorkerError


async def health(request: Request, tenant: str):
    """Liveness for anyone; the loaded models only for a caller with a valid key (or on a keyless worker)."""
    try:
        request.app.state.auth.tenant(request)
    except WorkerError:
        return {"status": "ok"}
    return {"status": "ok", "models_loaded": sorted(service_of(request).models.hosts)}


async def whoami(request: Request, tenant: str):
    return {"tenant": tenant}


async def capabilities(request: Request, tenant: str):
    return GetServerCapabilitiesResponse(supported_models=service_of(request).models.capabilities())


async def tokenizer(request: Request, tenant: str):
    model = request.query_params.get("model", "")
    return TokenizerFiles(model=model, files=await service_of(request).models.tokenizer_files(model))


ROUTES = [
    Route("/v1/health", endpoint(health, public=True)),
    Route("/v1/whoami", endpoint(whoami)),
    Route("/v1/capabilities", endpoint(capabilities)),
    Route("/v1/tokenizer", endpoint(tokenizer)),
]
