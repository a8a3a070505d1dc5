"""Control routes for checkpoints: the LoRA settings behind a checkpoint URI and the listings (per run and per
key); deleting one and its download URL are in downloads.py.

These are the service's checkpoints, whichever protocol saved them: the URI is the worker's ``trio://`` path and
the cuid the short id every protocol lists (``service.checkpoints.checkpoint_id``), so a checkpoint saved through
the native, Tinker or OpenAI API is listed, loadable and deletable here with the same key, and another key's are
invisible (404). Temporary sampler weights held in memory (save_weights_and_get_sampling_client) are not listed.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from pytrio_compat.wire import LoraSpec
from server_mock.api.pytrio import control_wire as cw
from server_mock.api.pytrio.control import page
from server_mock.api.pytrio.state import PytrioState, model_cuid, workspace_of
from server_mock.errors import WorkerError
from server_mock.service.checkpoints import checkpoint_id
from server_mock.storage.checkpoints import RUN_RE, CheckpointRef

KIND = {"state": "TRAINING", "sampler": "SAMPLER"}


async def checkpoint_config(state: PytrioState, request: Request, tenant: str):
    uri = request.query_params.get("checkpoint_uri", "")
    if not uri or len(uri) > cw.MAX_URI:
        raise WorkerError(400, "invalid_request", "checkpoint_uri: required, a trio:// checkpoint path",
                          "checkpoint_uri")
    checkpoints = state.service.checkpoints

    def read() -> dict:
        return checkpoints.store.read_meta(checkpoints.owned_ref(uri, tenant, "checkpoint_uri"))

    meta = await asyncio.to_thread(read)
    spec = LoraSpec.model_validate(meta["lora"])
    return cw.CheckpointConfigOut(base_model=state.service.models.tokenizer_id(meta["base_model"]),
                                  lora_rank=spec.rank, seed=spec.seed, train_mlp=spec.train_mlp,
                                  train_attn=spec.train_attn, train_unembed=spec.train_unembed)


def record(state: PytrioState, ref: CheckpointRef, meta: dict, size: int) -> cw.CheckpointRecordOut:
    created = cw.utc(meta.get("created_at", 0.0))
    run = state.training.get(ref.run_id)
    model_id = state.service.models.tokenizer_id(meta.get("base_model", ""))
    ttl = meta.get("ttl_seconds")
    cuid = checkpoint_id(ref.path)
    return cw.CheckpointRecordOut(
        cuid=cuid, checkpoint_cuid=cuid, training_run_cuid=ref.run_id, workspace_cuid=workspace_of(meta["tenant"]),
        name=ref.name, checkpoint_type=KIND[ref.kind], status="READY", checkpoint_uri=ref.path, model=model_id,
        base_model=model_id, model_spec_cuid=model_cuid(meta.get("base_model", "")), task_id=ref.run_id,
        task_created_at=cw.utc(run.created) if run is not None else created,
        task_status=run.status if run is not None else "ENDED", path=ref.path, created_at=created, size_bytes=size,
        lora_rank=int(meta.get("lora", {}).get("rank", 0)),
        expired_at=cw.utc(meta["created_at"] + ttl) if ttl and "created_at" in meta else None)


async def _listing(state: PytrioState, request: Request, tenant: str, run_cuid: str | None):
    rows = await asyncio.to_thread(state.service.checkpoints.records, tenant, run_cuid)
    rows.sort(key=lambda row: (row[1].get("created_at", 0.0), row[0].path))
    served, cursor = page(rows, request)
    return {"checkpoints": [record(state, *row).model_dump(mode="json") for row in served],
            "cursor": cursor.model_dump()}


async def list_run_checkpoints(state: PytrioState, request: Request, tenant: str):
    run_cuid = request.path_params["run"]
    if not RUN_RE.fullmatch(run_cuid):  # not a run id this worker makes: no checkpoints (not an error of the list)
        return {"checkpoints": [], "cursor": cw.CursorOut(offset=0, limit=1, total=0).model_dump()}
    return await _listing(state, request, tenant, run_cuid)


async def list_checkpoints(state: PytrioState, request: Request, tenant: str):
    return await _listing(state, request, tenant, None)
