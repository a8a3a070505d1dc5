"""Checkpoint downloads for ``RestClient.download_checkpoint``: the Control route that hands out a URL
(``GET checkpoints/{cuid}/download-url``) and the file route it points at (``GET /pytrio-files/{cuid}``).

The SDK fetches the URL with no credentials at all, so the URL carries them: an expiry and an HMAC-SHA256 of
(checkpoint, expiry, owner) under a secret drawn when the worker starts. Only the owner's key gets a URL; a URL
works until it expires (then 403, and the SDK asks for a new one) and names nothing of the owner. The file is one
uncompressed tar of the checkpoint's folder, written once (sorted names, fixed times and owners, so its bytes and
offsets are the same on every resume) and served with Range support by Starlette's ``FileResponse`` (206 from an
offset, 416 with ``Content-Range: bytes */size`` past the end).

This is the protocol's own minimal interface (``Downloads.archive``) until the worker has a shared archive and
download route for every protocol; switching means replacing ``archive`` and ``url``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import tarfile
import tempfile
import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from server_mock.api.pytrio import control_wire as cw
from server_mock.errors import WorkerError
from server_mock.service.checkpoints import checkpoint_id
from server_mock.service.worker import WorkerService
from server_mock.storage.checkpoints import CheckpointRef

FILES = "/pytrio-files"
URL_TTL_SECONDS = 900  # the SDK refreshes a URL with 60 s or less left


class Downloads:
    def __init__(self, service: WorkerService, ttl: float = URL_TTL_SECONDS) -> None:
        self.service = service
        self.ttl = ttl
        self._secret = secrets.token_bytes(32)
        self._folder = Path(service.store.root) / "archives"

    def _signature(self, cuid: str, expires: int, tenant: str) -> str:
        return hmac.new(self._secret, f"{cuid}|{expires}|{tenant}".encode(), hashlib.sha256).hexdigest()

    def _find(self, cuid: str, tenant: str | None) -> tuple[CheckpointRef, dict]:
        """The checkpoint on disk listed under ``cuid`` (of ``tenant``, or anyone's); 404 otherwise."""
        if len(cuid) == 16 and all(c in "0123456789abcdef" for c in cuid):
            for ref, meta, _ in self.service.store.list():
                if checkpoint_id(ref.path) == cuid and (tenant is None or meta.get("tenant", "") == tenant):
                    return ref, meta
        raise WorkerError(404, "checkpoint_not_found", f"checkpoint: unknown checkpoint {cuid[:64]!r}", "checkpoint")

    def _name(self, ref: CheckpointRef, meta: dict) -> str:
        return f"{checkpoint_id(ref.path)}-{int(meta.get('created_at', 0) * 1000)}.tar"

    def forget(self, cuid: str) -> None:
        """Drop a deleted checkpoint's archive."""
        for path in self._folder.glob(f"{cuid}-*.tar"):
            path.unlink(missing_ok=True)

    def sweep(self) -> int:
        """Drop archives of checkpoints that are gone (deleted, expired or overwritten); returns how many."""
        if not self._folder.is_dir():
            return 0
        current = {self._name(ref, meta) for ref, meta, _ in self.service.store.list()}
        removed = 0
        for path in self._folder.iterdir():
            stale = path.name.startswith(".building-") and time.time() - path.stat().st_mtime > 3600
            if stale or (path.suffix == ".tar" and not path.name.startswith(".") and path.name not in current):
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def archive(self, ref: CheckpointRef, meta: dict) -> Path:
        """The checkpoint as one tar file, built on first request."""
        folder = self.service.store.folder(ref)
        target = self._folder / self._name(ref, meta)
        if target.exists():
            return target
        self._folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._folder, prefix=".building-")
        try:
            with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for path in sorted(p for p in folder.iterdir() if p.is_file()):
                    info = tar.gettarinfo(str(path), arcname=f"{ref.name}/{path.name}")
                    info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
                    with open(path, "rb") as handle:
                        tar.addfile(info, handle)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    # --- routes ---------------------------------------------------------------------------------------------------

    async def download_url(self, state, request: Request, tenant: str):
        cuid = request.path_params["checkpoint"]
        await asyncio.to_thread(self._find, cuid, tenant)
        expires = int(time.time() + self.ttl)
        url = (f"{str(request.base_url).rstrip('/')}{FILES}/{cuid}?exp={expires}"
               f"&sig={self._signature(cuid, expires, tenant)}")
        return cw.DownloadUrlOut(url=url, expires_at=cw.utc(expires))

    async def file(self, request: Request):
        cuid = request.path_params["checkpoint"]
        expires, sig = request.query_params.get("exp", ""), request.query_params.get("sig", "")
        if not expires.isdigit() or len(expires) > 12 or int(expires) < time.time():
            return _forbidden("the download URL has expired or is malformed; ask for a new one")
        try:
            ref, meta = await asyncio.to_thread(self._find, cuid, None)
        except WorkerError:
            return _forbidden("the download URL is not valid")  # the same answer as a bad signature: no probing
        if not hmac.compare_digest(sig, self._signature(cuid, int(expires), meta.get("tenant", ""))):
            return _forbidden("the download URL is not valid")
        path = await asyncio.to_thread(self.archive, ref, meta)
        return FileResponse(path, media_type="application/x-tar", filename=f"{ref.name}.tar")

    async def delete_checkpoint(self, state, request: Request, tenant: str):
        """``DELETE checkpoints/{cuid}``: the checkpoint (any protocol's, of this key) and its archive."""
        cuid = request.path_params["checkpoint"]
        await asyncio.to_thread(self.service.checkpoints.delete, cuid, tenant)
        await asyncio.to_thread(self.forget, cuid)
        return Response(status_code=204)

    def routes(self) -> list[Route]:
        return [Route(FILES + "/{checkpoint}", self.file, methods=["GET", "HEAD"])]


def _forbidden(message: str) -> JSONResponse:
    return JSONResponse({"code": "forbidden", "message": message}, status_code=403)
