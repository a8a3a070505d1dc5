"""Tinker routes for the client's session and its training models: config, sessions, heartbeats,
capabilities, ``create_model`` and ``get_info``. Each handler is ``(state, request, tenant)``."""

from __future__ import annotations

import uuid

from starlette.requests import Request

from pytrio_compat.wire import CreateTrainingRun, LoraSpec
from server_mock.api.tinker import records, schemas
from server_mock.api.tinker.endpoint import read, read_body
from server_mock.api.tinker.state import TinkerState
from server_mock.errors import WorkerError, bad_request


async def client_config(state: TinkerState, request: Request, tenant: str):
    # Defaults for everything else; JWT auth stays off (keys are checked on every request).
    return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False}


async def dynamic_config(state: TinkerState, request: Request, tenant: str):
    return {}


async def create_session(state: TinkerState, request: Request, tenant: str):
    body, _ = await read(request, schemas.CreateSession, state.json_limit)
    labels = records.user_metadata(body.user_metadata)  # for RestClient.get_session / search_sessions
    display_name = body.display_name
    await state.expire()
    session = state.new_session(f"sess-{uuid.uuid4().hex[:20]}", tenant)
    session.user_metadata, session.display_name = labels, display_name[:1024] if display_name else None
    state.record_session(session)
    return {"session_id": session.session_id, "type": "create_session"}


async def heartbeat(state: TinkerState, request: Request, tenant: str):
    body, _ = await read(request, schemas.Heartbeat, state.json_limit)
    session = state.sessions.get(body.session_id) if body.session_id is not None else None
    if session is None or session.tenant != tenant:  # 410 tells the client to stop sending heartbeats
        raise WorkerError(410, "session_expired", "session_id: this session has finished or expired")
    session.last_seen = state.clock()
    return {"type": "session_heartbeat"}


async def telemetry(state: TinkerState, request: Request, tenant: str):
    await read_body(request, state.json_limit)
    return {"status": "accepted"}


async def finish_session(state: TinkerState, request: Request, tenant: str):
    await state.finish(state.session(request.path_params["session_id"], tenant))
    return {}


async def capabilities(state: TinkerState, request: Request, tenant: str):
    return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                  "trainable": True, "sampleable": True} for m in state.service.models.capabilities()]}


async def healthz(state: TinkerState, request: Request, tenant: str):
    return {"status": "ok"}


async def create_model(state: TinkerState, request: Request, tenant: str):
    body, _ = await read(request, schemas.CreateModel, state.json_limit)
    session = state.session(body.session_id, tenant)
    known = state.creation(session, body.model_seq_id)
    if known is not None:
        request_id, model_id = known
        return {"request_id": request_id, "model_id": model_id}
    lora = body.lora_config or schemas.LoraConfig()
    optimizer = body.optimizer_config or schemas.OptimizerConfig()
    labels = records.user_metadata(body.user_metadata)  # RestClient.get_training_run answers them
    state.count_creation(session, "model_seq_id")
    model_id = f"{session.session_id}:train:{body.model_seq_id}"
    request_id = state.futures.new_id()

    async def create() -> dict:
        if optimizer.type != "adamw":
            raise bad_request("optimizer_config.type", f"{optimizer.type[:60]!r} is not supported; this "
                                                       "worker trains with adamw only")
        spec = LoraSpec(**lora.model_dump(exclude_none=True))
        run = await state.service.runs.create(CreateTrainingRun(base_model=body.base_model, lora=spec), tenant)
        run.user_metadata = labels
        answer = {"model_id": model_id, "type": "create_model"}
        await state.register(session, model_id, run.run_id, run.base_model, labels,
                             (body.model_seq_id, request_id, answer))
        return answer

    state.futures.add_guarded(tenant, create(), request_id)
    state.add_creation(session, body.model_seq_id, request_id, model_id)
    return {"request_id": request_id, "model_id": model_id}


async def get_info(state: TinkerState, request: Request, tenant: str):
    """What the client needs to know about a model.

    The client loads the tokenizer itself with ``AutoTokenizer.from_pretrained(tokenizer_id)``, so
    ``tokenizer_id`` is what the model was served from (its hub id, or the absolute path of its folder, which
    a client on the worker's machine can load offline) unless the operator set ``--tokenizer-id NAME=ID``.
    Nothing else of the worker's filesystem (its storage) is named.
    """
    body, _ = await read(request, schemas.GetInfo, state.json_limit)
    model = state.model(body.model_id, tenant)
    run = state.service.runs.get(model.run_id, tenant)
    host = await state.service.models.host(run.base_model)
    return {
        "type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": run.spec.rank,
        "model_name": run.base_model,
        "model_data": {"arch": host.model_type, "model_name": run.base_model,
                       "tokenizer_id": state.service.models.tokenizer_id(run.base_model)},
    }
