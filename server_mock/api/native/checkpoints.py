"""Checkpoints on disk: config, listing, deletion, and the signed URL of a checkpoint's archive (a tar of its
PEFT adapter folder, served by api/downloads.py). The disk is read on a worker thread."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.routing import Route

from pytrio_compat.wire import CheckpointArchiveUrl
from server_mock.api.downloads import ARCHIVE
from server_mock.api.native.endpoint import endpoint, service_of
from server_mock.errors import bad_request


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


async def archive_url(request: Request, tenant: str):
    path = request.query_params.get("path", "")
    if not path:
        raise bad_request("path", "required: a trio:// checkpoint path, or a checkpoint id from list_checkpoints")
    url, expires = await request.app.state.downloads.url_for(request, ARCHIVE, path, tenant)
    return CheckpointArchiveUrl(url=url, expires_at=expires.timestamp())


ROUTES = [
    Route("/v1/checkpoints/archive_url", endpoint(archive_url), methods=["GET"]),
    Route("/v1/checkpoint_config", endpoint(checkpoint_config)),
    Route("/v1/checkpoints", endpoint(list_checkpoints), methods=["GET"]),
    Route("/v1/checkpoints", endpoint(delete_checkpoint), methods=["DELETE"]),
]
