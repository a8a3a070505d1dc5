"""Checkpoint downloads for ``RestClient.download_checkpoint``: the Control route that hands out a URL
(``GET checkpoints/{cuid}/download-url``, C19) and the deletion of a checkpoint (``DELETE checkpoints/{cuid}``).

The URL is the worker's shared signed download URL (server_mock/api/downloads.py) of the checkpoint's archive:
the same tar (``adapter_config.json``, ``adapter_model.safetensors``, ``checkpoint_complete``) every protocol
serves, built once beside the checkpoint (storage/archive.py). The SDK fetches it with no credentials; only the
owner's key gets a URL; it answers 403 once expired or altered (the SDK then asks for a new one), 404 once the
checkpoint is gone or overwritten, and serves ``Range`` (206, or 416 with ``bytes */size`` when complete).
"""

from __future__ import annotations

import asyncio
import re

from starlette.requests import Request
from starlette.responses import Response

from server_mock.api import downloads as shared
from server_mock.api.pytrio import control_wire as cw
from server_mock.errors import WorkerError
from server_mock.service.worker import WorkerService

_CUID = re.compile(r"^[0-9a-f]{16}$")


class Downloads:
    def __init__(self, service: WorkerService, links: shared.Downloads | None = None) -> None:
        self.service = service
        self.links = links or shared.Downloads(service.limits.download_url_seconds)
        if links is None:
            self.links.register(shared.ARCHIVE, shared.archive_resolver(service.checkpoints))

    def _path(self, cuid: str, tenant: str) -> str:
        """The trio:// path of this key's checkpoint listed under ``cuid``; 404 otherwise."""
        if not _CUID.match(cuid):
            raise WorkerError(404, "checkpoint_not_found", f"checkpoint: unknown checkpoint {cuid[:64]!r}",
                              "checkpoint")
        return self.service.checkpoints.resolve(cuid, tenant)

    async def download_url(self, state, request: Request, tenant: str):
        path = await asyncio.to_thread(self._path, request.path_params["checkpoint"], tenant)
        url, expires = await self.links.url_for(request, shared.ARCHIVE, path, tenant)
        return cw.DownloadUrlOut(url=url, expires_at=expires)

    async def delete_checkpoint(self, state, request: Request, tenant: str):
        """``DELETE checkpoints/{cuid}``: the checkpoint (any protocol's, of this key), its archive with it."""
        cuid = request.path_params["checkpoint"]
        await asyncio.to_thread(self.service.checkpoints.delete, cuid, tenant)
        return Response(status_code=204)
