"""Control routes for runs: create a training run (fresh, or from a checkpoint), point it at a checkpoint before its
first event (PATCH, ``load_state``), create sampling runs, renew their actor tokens, and describe them.

Creating a training run only records it and mints its token: its adapter is made by its first Actor event,
``trainer.init_run`` (loading a model can outlast the SDK's 30 s Control timeout; an event is polled). The per-key
run limit is checked here, before anything exists; a full worker answers ``429 actor_capacity_exceeded``, which
the SDK re-sends every 30 s until a slot frees.
"""

from __future__ import annotations

import asyncio
import uuid
from functools import partial

from starlette.requests import Request

from pytrio_compat.wire import CreateSampler, LoraSpec
from server_mock.api.pytrio import control_wire as cw
from server_mock.api.pytrio import models, training
from server_mock.api.pytrio.control import page
from server_mock.api.pytrio.endpoint import read_model
from server_mock.api.pytrio.events import EventTable
from server_mock.api.pytrio.state import PytrioState, SamplingRun, TrainingRun, model_cuid, workspace_of
from server_mock.engine.requests import run_id
from server_mock.errors import WorkerError, bad_request

ACTOR_PREFIX = "/pytrio-actor"


def actor_out(request: Request) -> cw.ActorOut:
    """The Actor plane, at the address the client reached this worker by."""
    return cw.ActorOut(actor_cuid="actor_local", endpoint=str(request.base_url).rstrip("/") + ACTOR_PREFIX)


def jwt_out(token: str, expires: float) -> cw.ActorJwtOut:
    return cw.ActorJwtOut(token=token, expires_at=cw.utc(expires))


async def _checkpoint_meta(state: PytrioState, uri: str, tenant: str, field: str) -> dict:
    return await asyncio.to_thread(state.service.checkpoints.state_meta, uri, tenant, field)


def _check_room(state: PytrioState, tenant: str) -> None:
    """The service's run quotas, counting this protocol's runs whose adapters are made at their first event."""
    waiting = [r for r in state.training.values() if r.init == "none"]  # created, adapter not made yet
    state.service.runs.check_room(tenant, pending=sum(1 for r in waiting if r.tenant == tenant),
                                  pending_all=len(waiting))


def new_events(state: PytrioState, run: TrainingRun) -> EventTable:
    """A training run's event table (its events run through ``training.execute``)."""
    options = state.options
    return EventTable(options.pytrio_events_per_run, options.pytrio_event_ttl, partial(training.execute, state, run),
                      options.pytrio_event_answer_bytes, forget=partial(state.journal.event_forgotten, run.cuid),
                      answers=state.answers, tenant=run.tenant)


async def create_training_run(state: PytrioState, request: Request, tenant: str):
    session = state.session(request.path_params["session"], tenant)
    body = await read_model(request, cw.TrainingRunCreateIn)
    uri = body.source_checkpoint_uri
    if uri:
        meta = await _checkpoint_meta(state, uri, tenant, "source_checkpoint_uri")
        alias = meta["base_model"]
        if body.base_model and models.resolve(state, body.base_model) != alias:
            raise bad_request("base_model", f"{uri} was trained on {alias!r}, not {body.base_model!r}")
        spec = LoraSpec.model_validate(meta["lora"])
    else:
        alias = models.resolve(state, body.base_model)
        spec = LoraSpec(rank=body.lora_rank, seed=body.seed, train_mlp=body.train_mlp, train_attn=body.train_attn,
                        train_unembed=body.train_unembed)
    state.service.runs.check_spec(spec, rank_field="lora_rank", switches_field="train_mlp")
    _check_room(state, tenant)
    now = state.clock()
    run = TrainingRun(cuid=run_id("run"), tenant=tenant, session_cuid=session.cuid,
                      run_index=len(state.training_cuids(session)) + 1, alias=alias,
                      model_id=state.service.models.tokenizer_id(alias), lora=spec, source_uri=uri,
                      restore_optimizer=body.restore_optimizer and bool(uri), created=now, last_seen=now)
    run.events = new_events(state, run)
    state.add_training(run, session)
    models.preload(state, alias)
    return cw.TrainingRunCreatedOut(
        training_run_cuid=run.cuid, service_session_cuid=session.cuid, workspace_cuid=workspace_of(tenant),
        status=run.status, run_index=run.run_index, model_spec_cuid=model_cuid(alias), model_alias=alias,
        model_id=run.model_id, trainer=models.trainer_limits(state, alias), actor=actor_out(request),
        actor_jwt=jwt_out(run.token, run.token_expires), created_at=cw.utc(run.created))


async def update_training_run(state: PytrioState, request: Request, tenant: str):
    """PATCH (load_state*): the run starts from a checkpoint; only before its first event."""
    session = state.session(request.path_params["session"], tenant)
    run = state.training_run(request.path_params["run"], tenant)
    if run.session_cuid != session.cuid:
        raise WorkerError(404, "training_run_not_found", f"training_run: {run.cuid} is not a run of service session "
                                                         f"{session.cuid}", "training_run_cuid")
    body = await read_model(request, cw.TrainingRunUpdateIn)
    if run.init != "none" or run.events.next_index > 1:
        raise WorkerError(409, "already_initialized", "training_run: load_state must come before the run's first "
                                                      "call; create a new training client instead")
    meta = await _checkpoint_meta(state, body.source_checkpoint_uri, tenant, "source_checkpoint_uri")
    state.service.checkpoints.check_layout(meta, run.lora, run.alias, "source_checkpoint_uri")
    run.source_uri, run.restore_optimizer = body.source_checkpoint_uri, body.restore_optimizer
    token, expires = state.renew(run)
    return cw.TrainingRunUpdatedOut(source_checkpoint_uri=run.source_uri, restore_optimizer=run.restore_optimizer,
                                    trainer=models.trainer_limits(state, run.alias), actor=actor_out(request),
                                    actor_jwt=jwt_out(token, expires))


async def create_sampling_run(state: PytrioState, request: Request, tenant: str):
    session = state.session(request.path_params["session"], tenant)
    body = await read_model(request, cw.SamplingRunCreateIn)
    alias = models.resolve(state, body.base_model) if body.base_model else None
    uri = body.source_checkpoint_uri or None
    if alias is None and uri is None:
        raise bad_request("base_model", "required when source_checkpoint_uri is empty")
    sampler = await state.service.samplers.create(CreateSampler(base_model=alias, model_path=uri), tenant)
    alias = sampler.base_model
    now = state.clock()
    run = SamplingRun(cuid="sr_" + uuid.uuid4().hex[:20], tenant=tenant, session_cuid=session.cuid,
                      run_index=len(state.sampling_cuids(session)) + 1, alias=alias,
                      model_id=state.service.models.tokenizer_id(alias), source_uri=uri or "",
                      sampler_id=sampler.sampler_id, created=now, last_used=now)
    state.add_sampling(run, session)
    return cw.SamplingRunCreatedOut(
        sampling_run_cuid=run.cuid, service_session_cuid=session.cuid, workspace_cuid=workspace_of(tenant),
        status="READY", run_index=run.run_index, model_spec_cuid=model_cuid(alias), model_alias=alias,
        model_id=run.model_id, sampler=models.sampler_limits(state, alias), actor=actor_out(request),
        actor_jwt=jwt_out(run.token, run.token_expires), created_at=cw.utc(run.created))


async def renew_training_run(state: PytrioState, request: Request, tenant: str):
    run = state.training_run(request.path_params["run"], tenant)
    state.touch_session(run.session_cuid)
    token, expires = state.renew(run)
    return cw.TrainingRunRenewedOut(training_run_cuid=run.cuid, service_session_cuid=run.session_cuid,
                                    workspace_cuid=workspace_of(tenant), actor=actor_out(request),
                                    actor_jwt=jwt_out(token, expires))


async def renew_sampling_run(state: PytrioState, request: Request, tenant: str):
    run = state.sampling_run(request.path_params["run"], tenant)
    state.touch_session(run.session_cuid)
    token, expires = state.renew(run)
    return cw.SamplingRunRenewedOut(sampling_run_cuid=run.cuid, service_session_cuid=run.session_cuid,
                                    workspace_cuid=workspace_of(tenant), actor=actor_out(request),
                                    actor_jwt=jwt_out(token, expires))


def training_run_out(state: PytrioState, run: TrainingRun) -> cw.TrainingRunOut:
    spec = run.lora
    return cw.TrainingRunOut(
        training_run_cuid=run.cuid, base_model=run.model_id, service_session_cuid=run.session_cuid,
        workspace_cuid=workspace_of(run.tenant), status=run.status, run_index=run.run_index,
        model_spec_cuid=model_cuid(run.alias), source_checkpoint_uri=run.source_uri or None,
        restore_optimizer=run.restore_optimizer, lora_rank=spec.rank, seed=spec.seed, train_mlp=spec.train_mlp,
        train_attn=spec.train_attn, train_unembed=spec.train_unembed,
        training_params=cw.TrainingParamsOut(restore_optimizer=run.restore_optimizer, lora_rank=spec.rank,
                                             seed=spec.seed, train_mlp=spec.train_mlp, train_attn=spec.train_attn,
                                             train_unembed=spec.train_unembed),
        created_at=cw.utc(run.created), updated_at=cw.utc(run.last_seen))


async def get_training_run(state: PytrioState, request: Request, tenant: str):
    return training_run_out(state, state.training_run(request.path_params["run"], tenant))


async def list_training_runs(state: PytrioState, request: Request, tenant: str):
    mine = sorted((r for r in state.training.values() if r.tenant == tenant), key=lambda r: r.created)
    rows, cursor = page(mine, request)
    return {"training_runs": [training_run_out(state, r).model_dump(mode="json") for r in rows],
            "cursor": cursor.model_dump()}


async def get_sampling_run(state: PytrioState, request: Request, tenant: str):
    run = state.sampling_run(request.path_params["run"], tenant, use=False)
    return cw.SamplingRunOut(sampling_run_cuid=run.cuid, service_session_cuid=run.session_cuid,
                             workspace_cuid=workspace_of(tenant), status="READY", base_model=run.alias,
                             model_id=run.model_id, alias=run.alias, source_checkpoint_uri=run.source_uri or None,
                             created_at=cw.utc(run.created), updated_at=cw.utc(run.last_used))
