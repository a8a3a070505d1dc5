"""Checkpoints on disk: config, listing, deletion. The disk is read on a worker thread."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.routing import Route

from server_mock.api.native.endpoint import endpoint, service_of


async def checkpoint_config(request: Request, tenant: str):
    checkpoints = service_of(request).checkpoints
    return await asyncio.to_thread(checkpoints.config, request.query_params.get("path", ""), tenant)


async def list_checkpoints(request: Request, tenant: str):
    run = request.query_params.get("training_run_id") or None
    return await asyncio.to_thread(service_of(request).checkpoints.list, tenant, run)


async def delete_checkpoint(request: Request, tenant: str):
    checkpoints = service_of(request).checkpoints
    await asyncio.to_thread(checkpoints.delete, request.query_params.get("path", ""), tenant)
    return {"deleted": True}


ROUTES = [
    Route("/v1/checkpoint_config", endpoint(checkpoint_config)),
    Route("/v1/checkpoints", endpoint(list_checkpoints), methods=["GET"]),
    Route("/v1/checkpoints", endpoint(delete_checkpoint), methods=["DELETE"]),
]
