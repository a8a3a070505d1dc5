"""Tinker routes for weights: save a model's state or sampler weights, load a checkpoint into a model
(or into a new one), and describe a checkpoint. Saves and loads of an existing model are ordered by
its seq_id like training operations."""

from __future__ import annotations

import uuid

from starlette.requests import Request

from pytrio_compat.wire import CreateSampler, CreateTrainingRun, LoadOp, SaveOp
from server_mock.api.tinker import records
from server_mock.api.tinker.endpoint import field, read_json, read_json_sized
from server_mock.api.tinker.paths import to_tinker_path, to_trio_path
from server_mock.api.tinker.state import TinkerState
from server_mock.api.tinker.submit import gated


async def save_weights(state: TinkerState, request: Request, tenant: str):
    body, size, body_digest = await read_json_sized(request, state.body_limit)
    model = state.model(field(body, "model_id", str), tenant)

    def payload() -> SaveOp:
        return SaveOp(op="save_state", name=body.get("path") or f"state-{uuid.uuid4().hex[:12]}",
                      ttl_seconds=body.get("ttl_seconds"), overwrite=bool(body.get("overwrite", False)),
                      user_metadata=records.user_metadata(body.get("user_metadata")))

    def convert(result: dict) -> dict:
        return {"path": to_tinker_path(result["path"]), "type": "save_weights"}

    return gated(state, tenant, model, body.get("seq_id"), body_digest, payload, convert, size)


async def save_weights_for_sampler(state: TinkerState, request: Request, tenant: str):
    body, size, body_digest = await read_json_sized(request, state.body_limit)
    model = state.model(field(body, "model_id", str), tenant)
    name = body.get("path")

    if name is not None:
        def payload() -> SaveOp:
            return SaveOp(op="save_weights_for_sampler", name=name, ttl_seconds=body.get("ttl_seconds"),
                          user_metadata=records.user_metadata(body.get("user_metadata")))

        def convert(result: dict) -> dict:
            return {"path": to_tinker_path(result["path"]), "type": "save_weights_for_sampler"}
    else:
        # save_weights_and_get_sampling_client: an in-memory snapshot and a sampler on it
        def payload() -> SaveOp:
            return SaveOp(op="save_weights_for_sampler", name=f"tinker-{uuid.uuid4().hex[:16]}", ephemeral=True)

        async def convert(result: dict) -> dict:
            sampler = await state.service.samplers.create(CreateSampler(model_path=result["path"]), tenant)
            session = state.sessions.get(model.session_id)
            if session is not None:  # its samples may be recorded for stable_reinforce
                state.add_session_sampler(session, sampler.sampler_id)
            return {"sampling_session_id": sampler.sampler_id, "type": "save_weights_for_sampler"}

    return gated(state, tenant, model, body.get("seq_id"), body_digest, payload, convert, size)


async def load_weights(state: TinkerState, request: Request, tenant: str):
    body, size, body_digest = await read_json_sized(request, state.body_limit)
    path = field(body, "path", str)
    with_optimizer = bool(body.get("optimizer", False))
    if body.get("model_id") is not None:  # load into an existing training model
        model = state.model(field(body, "model_id", str), tenant)

        def payload() -> LoadOp:
            return LoadOp(path=to_trio_path(path), load_optimizer=with_optimizer)

        def convert(result: dict) -> dict:
            return {"path": path, "model_id": model.model_id, "type": "load_weights"}

        return gated(state, tenant, model, body.get("seq_id"), body_digest, payload, convert, size)

    # create_training_client_from_state*: a new model whose first request is this load
    session = state.session(field(body, "session_id", str), tenant)
    model_seq_id = field(body, "model_seq_id", int)
    key = (session.session_id, model_seq_id)
    if key in state.creations:
        request_id, model_id = state.creations[key]
        return {"request_id": request_id, "model_id": model_id}
    state.count_creation(session, "model_seq_id")
    model_id = f"{session.session_id}:train:{model_seq_id}"
    base_model = body.get("base_model")
    labels = records.user_metadata(body.get("user_metadata"))

    async def create() -> dict:
        create_body = CreateTrainingRun(base_model=base_model, from_checkpoint=to_trio_path(path),
                                        load_optimizer=with_optimizer)
        run = await state.service.runs.create(create_body, tenant)
        run.user_metadata = labels
        await state.register(session, model_id, run.run_id, run.base_model, labels)
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    request_id = state.futures.add_guarded(tenant, create())
    state.creations[key] = (request_id, model_id)
    return {"request_id": request_id, "model_id": model_id}


async def weights_info(state: TinkerState, request: Request, tenant: str):
    body = await read_json(request, state.body_limit)
    config = state.service.checkpoints.config(to_trio_path(field(body, "tinker_path", str), "tinker_path"), tenant)
    return {"base_model": config.base_model, "is_lora": True, "lora_rank": config.lora.rank,
            "train_unembed": config.lora.train_unembed, "train_mlp": config.lora.train_mlp,
            "train_attn": config.lora.train_attn}
