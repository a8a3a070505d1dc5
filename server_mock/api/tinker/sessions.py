"""Tinker routes for the client's session and its training models: config, sessions, heartbeats,
capabilities, ``create_model`` and ``get_info``. Each handler is ``(state, request, tenant)``."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request

from pytrio_compat.wire import CreateTrainingRun, LoraSpec
from server_mock.api.tinker import records
from server_mock.api.tinker.endpoint import field, read_body, read_json
from server_mock.api.tinker.state import TinkerState
from server_mock.errors import WorkerError, bad_request

LORA_FIELDS = ("rank", "seed", "train_mlp", "train_attn", "train_unembed")


async def client_config(state: TinkerState, request: Request, tenant: str):
    # Defaults for everything else; JWT auth stays off (keys are checked on every request).
    return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False}


async def dynamic_config(state: TinkerState, request: Request, tenant: str):
    return {}


async def create_session(state: TinkerState, request: Request, tenant: str):
    body = await read_json(request, state.body_limit)
    labels = records.user_metadata(body.get("user_metadata"))  # for RestClient.get_session / search_sessions
    display_name = field(body, "display_name", str, required=False)
    await state.expire()
    session = state.new_session(f"sess-{uuid.uuid4().hex[:20]}", tenant)
    session.user_metadata, session.display_name = labels, display_name[:1024] if display_name else None
    return {"session_id": session.session_id, "type": "create_session"}


async def heartbeat(state: TinkerState, request: Request, tenant: str):
    body = await read_json(request, state.body_limit)
    session = state.sessions.get(str(body.get("session_id")))
    if session is None or session.tenant != tenant:  # 410 tells the client to stop sending heartbeats
        raise WorkerError(410, "session_expired", "session_id: this session has finished or expired")
    session.last_seen = time.time()
    return {"type": "session_heartbeat"}


async def telemetry(state: TinkerState, request: Request, tenant: str):
    await read_body(request, state.body_limit)
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
    body = await read_json(request, state.body_limit)
    session = state.session(field(body, "session_id", str), tenant)
    model_seq_id = field(body, "model_seq_id", int)
    base_model = field(body, "base_model", str)
    key = (session.session_id, model_seq_id)
    if key in state.creations:
        request_id, model_id = state.creations[key]
        return {"request_id": request_id, "model_id": model_id}
    lora = field(body, "lora_config", dict, required=False, default={})
    optimizer = field(body, "optimizer_config", dict, required=False, default={})
    labels = records.user_metadata(body.get("user_metadata"))  # RestClient.get_training_run answers them
    state.count_creation(session, "model_seq_id")
    model_id = f"{session.session_id}:train:{model_seq_id}"

    async def create() -> dict:
        if optimizer.get("type", "adamw") != "adamw":
            raise bad_request("optimizer_config.type", f"{optimizer.get('type')!r} is not supported; this "
                                                       "worker trains with adamw only")
        spec = LoraSpec(**{k: lora[k] for k in LORA_FIELDS if lora.get(k) is not None})
        run = await state.service.runs.create(CreateTrainingRun(base_model=base_model, lora=spec), tenant)
        run.user_metadata = labels
        await state.register(session, model_id, run.run_id, run.base_model, labels)
        return {"model_id": model_id, "type": "create_model"}

    request_id = state.futures.add_guarded(tenant, create())
    state.creations[key] = (request_id, model_id)
    return {"request_id": request_id, "model_id": model_id}


async def get_info(state: TinkerState, request: Request, tenant: str):
    """What the client needs to know about a model.

    The client loads the tokenizer itself with ``AutoTokenizer.from_pretrained(tokenizer_id)``, so
    ``tokenizer_id`` is what the model was served from (its hub id, or the absolute path of its folder, which
    a client on the worker's machine can load offline) unless the operator set ``--tokenizer-id NAME=ID``.
    Nothing else of the worker's filesystem (its storage) is named.
    """
    body = await read_json(request, state.body_limit)
    model = state.model(field(body, "model_id", str), tenant)
    run = state.service.runs.get(model.run_id, tenant)
    host = await state.service.models.host(run.base_model)
    return {
        "type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": run.spec.rank,
        "model_name": run.base_model,
        "model_data": {"arch": host.model_type, "model_name": run.base_model,
                       "tokenizer_id": state.service.models.tokenizer_id(run.base_model)},
    }
