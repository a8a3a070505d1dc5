"""RestClient: list, delete and download checkpoints, look up runs and samplers."""

from __future__ import annotations

import concurrent.futures
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from . import download
from .errors import ValidationError
from .types import (
    APIFuture,
    Checkpoint,
    CheckpointArchiveUrlResponse,
    CheckpointDownloadResult,
    CheckpointDownloadSource,
    CheckpointsListResponse,
    Cursor,
    GetSamplerResponse,
    TrainingRun,
    TrainingRunsResponse,
)
from .wire import MAX_LIST_LIMIT, CheckpointArchiveUrl, CheckpointList, SamplerInfo, TrainingRunInfo, TrainingRunList

if TYPE_CHECKING:
    from .service_client import ServiceClient


class RestClient:
    def __init__(self, service: "ServiceClient") -> None:
        self._rt = service._runtime

    async def _list_checkpoints(self, training_run_id: str | None) -> CheckpointsListResponse:
        params = {"training_run_id": training_run_id} if training_run_id else {}
        raw = await self._rt.request("GET", "/v1/checkpoints", params=params, operation="list_checkpoints")
        entries = CheckpointList.model_validate(raw).checkpoints
        checkpoints = [
            Checkpoint(checkpoint_id=e.checkpoint_id, checkpoint_type="training" if e.kind == "state" else "sampler",
                       time=datetime.fromtimestamp(e.created_at, tz=timezone.utc), path=e.path,
                       size_bytes=e.size_bytes)
            for e in entries
        ]
        return CheckpointsListResponse(checkpoints=checkpoints,
                                       cursor=Cursor(offset=0, limit=len(checkpoints), total_count=len(checkpoints)))

    def list_checkpoints(self, training_run_id: str) -> concurrent.futures.Future:
        _require(training_run_id, "training_run_id")
        return self._rt.submit(self._list_checkpoints(training_run_id))

    async def list_checkpoints_async(self, training_run_id: str) -> CheckpointsListResponse:
        _require(training_run_id, "training_run_id")
        return await self._rt.run_async(self._list_checkpoints(training_run_id))

    async def _user_checkpoints(self, limit: int, offset: int) -> CheckpointsListResponse:
        everything = await self._list_checkpoints(None)
        page = everything.checkpoints[offset:offset + limit]
        return CheckpointsListResponse(checkpoints=page, cursor=Cursor(offset=offset, limit=limit,
                                                                       total_count=len(everything.checkpoints)))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> concurrent.futures.Future:
        """One page of the caller's checkpoints of every run (``limit`` from ``offset``), with the total count."""
        _page(limit, offset)
        return self._rt.submit(self._user_checkpoints(limit, offset))

    async def list_user_checkpoints_async(self, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
        _page(limit, offset)
        return await self._rt.run_async(self._user_checkpoints(limit, offset))

    async def _delete(self, path: str) -> None:
        await self._rt.request("DELETE", "/v1/checkpoints", params={"path": path}, operation="delete_checkpoint")

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> concurrent.futures.Future:
        """``checkpoint_id`` may be the id from list_checkpoints or the checkpoint's trio:// path."""
        _require(training_run_id, "training_run_id")
        _require(checkpoint_id, "checkpoint_id")
        return self._rt.submit(self._delete(checkpoint_id))

    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        _require(checkpoint_id, "checkpoint_id")
        await self._rt.run_async(self._delete(checkpoint_id))

    async def _archive_url(self, checkpoint_id: str) -> CheckpointArchiveUrlResponse:
        raw = await self._rt.request("GET", "/v1/checkpoints/archive_url", params={"path": checkpoint_id},
                                     operation="get_checkpoint_archive_url")
        info = CheckpointArchiveUrl.model_validate(raw)
        return CheckpointArchiveUrlResponse(url=info.url, expires=datetime.fromtimestamp(info.expires_at, timezone.utc))

    def get_checkpoint_archive_url(self, checkpoint_id: str) -> concurrent.futures.Future:
        """A signed URL of the checkpoint's archive (a tar of its PEFT adapter folder) and its expiry; the URL
        needs no API key. ``checkpoint_id``: the id from list_checkpoints or the checkpoint's trio:// path."""
        _require(checkpoint_id, "checkpoint_id")
        return self._rt.submit(self._archive_url(checkpoint_id))

    async def get_checkpoint_archive_url_async(self, checkpoint_id: str) -> CheckpointArchiveUrlResponse:
        _require(checkpoint_id, "checkpoint_id")
        return await self._rt.run_async(self._archive_url(checkpoint_id))

    async def _download_source(self, checkpoint_id: str) -> CheckpointDownloadSource:
        signed = await self._archive_url(checkpoint_id)
        return CheckpointDownloadSource(checkpoint_id=checkpoint_id, url=signed.url, expires=signed.expires)

    def get_checkpoint_download_url(self, checkpoint_id: str) -> concurrent.futures.Future:
        """Where to download the checkpoint's archive from (the worker itself: ``source`` "actor"), until when."""
        _require(checkpoint_id, "checkpoint_id")
        return self._rt.submit(self._download_source(checkpoint_id))

    async def get_checkpoint_download_url_async(self, checkpoint_id: str) -> CheckpointDownloadSource:
        _require(checkpoint_id, "checkpoint_id")
        return await self._rt.run_async(self._download_source(checkpoint_id))

    async def _download(self, checkpoint_id: str, destination: Path, resume: bool) -> CheckpointDownloadResult:
        async def source() -> download.Source:
            signed = await self._archive_url(checkpoint_id)
            return download.Source(signed.url, signed.expires)

        done = await download.download(await source(), source, destination, resume=resume, config=self._rt.config)
        return CheckpointDownloadResult(checkpoint_id=checkpoint_id, path=str(destination),
                                        bytes_written=done.bytes_written, file_size_bytes=done.file_size_bytes,
                                        status_code=done.status_code, resumed=done.resumed)

    def download_checkpoint(self, checkpoint_id: str, destination_path: str | Path, *,
                            resume: bool = True) -> concurrent.futures.Future:
        """Download the checkpoint's archive to the file ``destination_path`` (a tar holding
        adapter_config.json, adapter_model.safetensors and checkpoint_complete; extract it with
        ``tarfile.open(path).extractall(folder, filter="data")`` or pass it to ``pytrio-compat export``).
        With ``resume``, a partial file there is completed instead of fetched again."""
        _require(checkpoint_id, "checkpoint_id")
        return self._rt.submit(self._download(checkpoint_id, Path(destination_path), resume))

    async def download_checkpoint_async(self, checkpoint_id: str, destination_path: str | Path, *,
                                        resume: bool = True) -> CheckpointDownloadResult:
        _require(checkpoint_id, "checkpoint_id")
        return await self._rt.run_async(self._download(checkpoint_id, Path(destination_path), resume))

    async def _get_training_run(self, training_run_id: str) -> TrainingRun:
        raw = await self._rt.request("GET", f"/v1/training_runs/{training_run_id}", operation="get_training_run")
        info = TrainingRunInfo.model_validate(raw)
        return TrainingRun(training_run_id=info.training_run_id, base_model=info.base_model, is_lora=True,
                           lora_rank=info.lora.rank, last_request_time=datetime.now(tz=timezone.utc))

    def get_training_run(self, training_run_id: str, access_scope: str = "owned") -> concurrent.futures.Future:
        _require(training_run_id, "training_run_id")
        return self._rt.submit(self._get_training_run(training_run_id))

    async def get_training_run_async(self, training_run_id: str, access_scope: str = "owned") -> TrainingRun:
        _require(training_run_id, "training_run_id")
        return await self._rt.run_async(self._get_training_run(training_run_id))

    async def _list_training_runs(self, limit: int, offset: int) -> TrainingRunsResponse:
        raw = await self._rt.request("GET", "/v1/training_runs", params={"limit": limit, "offset": offset},
                                     operation="list_training_runs")
        page = TrainingRunList.model_validate(raw)
        now = datetime.now(tz=timezone.utc)
        runs = [TrainingRun(training_run_id=info.training_run_id, base_model=info.base_model, is_lora=True,
                            lora_rank=info.lora.rank, last_request_time=now) for info in page.training_runs]
        return TrainingRunsResponse(training_runs=runs,
                                    cursor=Cursor(offset=offset, limit=limit, total_count=page.total_count))

    def list_training_runs(self, limit: int = 20, offset: int = 0,
                           access_scope: str = "owned") -> concurrent.futures.Future:
        """One page of the caller's live training runs, oldest first (the worker's runs are all "owned")."""
        _page(limit, offset)
        return self._rt.submit(self._list_training_runs(limit, offset))

    async def list_training_runs_async(self, limit: int = 20, offset: int = 0,
                                       access_scope: str = "owned") -> TrainingRunsResponse:
        _page(limit, offset)
        return await self._rt.run_async(self._list_training_runs(limit, offset))

    async def _get_sampler(self, sampler_id: str) -> GetSamplerResponse:
        raw = await self._rt.request("GET", f"/v1/samplers/{sampler_id}", operation="get_sampler")
        info = SamplerInfo.model_validate(raw)
        return GetSamplerResponse(sampler_id=info.sampler_id, base_model=info.base_model, model_path=info.model_path)

    def get_sampler(self, sampler_id: str) -> APIFuture[GetSamplerResponse]:
        _require(sampler_id, "sampler_id")
        return APIFuture(self._rt.submit(self._get_sampler(sampler_id)))

    async def get_sampler_async(self, sampler_id: str) -> GetSamplerResponse:
        _require(sampler_id, "sampler_id")
        return await self._rt.run_async(self._get_sampler(sampler_id))


def _require(value: str, name: str) -> None:
    if not value:
        raise ValidationError(f"{name} cannot be empty", code="validation.empty_rest_argument")


def _page(limit: int, offset: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValidationError(f"limit must be an integer in [1, {MAX_LIST_LIMIT}], got {limit!r}",
                              code="validation.invalid_page")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValidationError(f"offset must be an integer >= 0, got {offset!r}", code="validation.invalid_page")
