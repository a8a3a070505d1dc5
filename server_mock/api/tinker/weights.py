"""Tinker routes for weights: save a model's state or sampler weights, load a checkpoint into a model
(or into a new one), and describe a checkpoint. Saves and loads of an existing model are ordered by
its seq_id like training operations."""

from __future__ import annotations

import asyncio
import uuid

from starlette.requests import Request

from pytrio_compat.wire import CreateTrainingRun, LoadOp, SaveOp
from server_mock.api.tinker import records, schemas
from server_mock.api.tinker.answers import Answer
from server_mock.api.tinker.endpoint import read
from server_mock.api.tinker.paths import to_trio_path
from server_mock.api.tinker.state import TinkerState
from server_mock.api.tinker.submit import gated, read_op
from server_mock.errors import bad_request


async def save_weights(state: TinkerState, request: Request, tenant: str):
    body, size = await read_op(state, request, tenant, schemas.SaveWeights)
    model = state.model(body.model_id, tenant)

    def payload() -> SaveOp:
        return SaveOp(op="save_state", name=body.path or f"state-{uuid.uuid4().hex[:12]}",
                      ttl_seconds=body.ttl_seconds, overwrite=body.overwrite,
                      user_metadata=records.user_metadata(body.user_metadata))

    return gated(state, tenant, model, body.seq_id, body.digest(), payload, Answer("save", {"type": "save_weights"}),
                 size)


async def save_weights_for_sampler(state: TinkerState, request: Request, tenant: str):
    body, size = await read_op(state, request, tenant, schemas.SaveWeightsForSampler)
    model = state.model(body.model_id, tenant)
    name = body.path

    if name is not None:
        def payload() -> SaveOp:
            return SaveOp(op="save_weights_for_sampler", name=name, ttl_seconds=body.ttl_seconds,
                          user_metadata=records.user_metadata(body.user_metadata))

        answer = Answer("save", {"type": "save_weights_for_sampler"})
    else:
        # save_weights_and_get_sampling_client: an in-memory snapshot and a sampler on it
        def payload() -> SaveOp:
            return SaveOp(op="save_weights_for_sampler", name=f"tinker-{uuid.uuid4().hex[:16]}", ephemeral=True)

        answer = Answer("snapshot")

    return gated(state, tenant, model, body.seq_id, body.digest(), payload, answer, size)


async def load_weights(state: TinkerState, request: Request, tenant: str):
    body, size = await read_op(state, request, tenant, schemas.LoadWeights)
    path, with_optimizer = body.path, body.optimizer
    if body.model_id is not None:  # load into an existing training model
        model = state.model(body.model_id, tenant)

        def payload() -> LoadOp:
            return LoadOp(path=to_trio_path(path), load_optimizer=with_optimizer)

        return gated(state, tenant, model, body.seq_id, body.digest(), payload, Answer("load", {"path": path}), size)

    # create_training_client_from_state*: a new model whose first request is this load
    if body.session_id is None:
        raise bad_request("session_id", "required")
    if body.model_seq_id is None:
        raise bad_request("model_seq_id", "required")
    session = state.session(body.session_id, tenant)
    model_seq_id = body.model_seq_id
    known = state.creation(session, model_seq_id)
    if known is not None:
        request_id, model_id = known
        return {"request_id": request_id, "model_id": model_id}
    state.count_creation(session, "model_seq_id")
    model_id = f"{session.session_id}:train:{model_seq_id}"
    base_model = body.base_model
    labels = records.user_metadata(body.user_metadata)

    request_id = state.futures.new_id()

    async def create() -> dict:
        create_body = CreateTrainingRun(base_model=base_model, from_checkpoint=to_trio_path(path),
                                        load_optimizer=with_optimizer)
        run = await state.service.runs.create(create_body, tenant)
        run.user_metadata = labels
        answer = {"path": path, "model_id": model_id, "type": "load_weights"}
        await state.register(session, model_id, run.run_id, run.base_model, labels, (model_seq_id, request_id, answer))
        return answer

    state.futures.add_guarded(tenant, create(), request_id)
    state.add_creation(session, model_seq_id, request_id, model_id)
    return {"request_id": request_id, "model_id": model_id}


async def weights_info(state: TinkerState, request: Request, tenant: str):
    body, _ = await read(request, schemas.WeightsInfo, state.json_limit)
    path = to_trio_path(body.tinker_path, "tinker_path")
    config = await asyncio.to_thread(state.service.checkpoints.config, path, tenant)  # reads meta.json
    return {"base_model": config.base_model, "is_lora": True, "lora_rank": config.lora.rank,
            "train_unembed": config.lora.train_unembed, "train_mlp": config.lora.train_mlp,
            "train_attn": config.lora.train_attn}
