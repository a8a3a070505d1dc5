"""Tinker's REST API (``tinker.RestClient``, the ``tinker`` CLI, the cookbook's checkpoint helpers): training
runs, checkpoints (list, delete, TTL) and sessions, for the caller's API key only (another key's objects do not
exist: 404). Hosted-only features (projects, billing, audit, trace export, cross-project copies, publishing)
are answered with a 400 that says why.

A training run is known while its model is live or while it has a checkpoint on disk: its base model, LoRA
rank and ``user_metadata`` are kept in every checkpoint's metadata, so it is still listed after its session
finished or the worker restarted. Listings read checkpoint metadata from disk, in a thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from server_mock.api.bodies import first_error
from server_mock.api.tinker import records
from server_mock.api.tinker.endpoint import read_json
from server_mock.api.tinker.state import TinkerState
from server_mock.errors import WorkerError, bad_request, not_found
from server_mock.storage.checkpoints import RUN_RE, CheckpointRef

MIN_TTL_SECONDS = 3600  # Tinker's documented bounds for set_checkpoint_ttl: 1 hour to 10 years
MAX_TTL_SECONDS = 10 * 365 * 86400
MAX_PAGE = 1000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Page(_Strict):
    limit: int = Field(20, ge=1, le=MAX_PAGE)
    offset: int = Field(0, ge=0, le=10**9)
    access_scope: Literal["owned", "accessible"] = "owned"  # nothing is shared between keys: the same set


class RunsPage(Page):
    project_id: str | None = Field(None, max_length=256)


class TtlBody(_Strict):
    ttl_seconds: int | None = Field(..., ge=MIN_TTL_SECONDS, le=MAX_TTL_SECONDS)


class ScopeQuery(_Strict):
    access_scope: Literal["owned", "accessible"] = "owned"


class SearchCursor(BaseModel):
    last_created_at: AwareDatetime
    last_session_id: str = Field(..., max_length=256)


class SessionSearch(BaseModel):
    """``SessionSearchRequest``: served over this worker's live sessions of the caller."""

    model_config = ConfigDict(extra="ignore")
    session_id: str | None = Field(None, max_length=256)
    project_ids: list[str] | None = Field(None, max_length=64)
    user_metadata: dict[str, str] = Field(default_factory=dict, max_length=records.MAX_METADATA_KEYS)
    display_name: str | None = Field(None, min_length=1, max_length=1024)
    owner: dict = Field(default_factory=lambda: {"type": "own"})
    statuses: list[dict] | None = Field(None, min_length=1, max_length=16)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursor | None = None


def _parse(model: type[BaseModel], data: dict, where: str = "query"):
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = first_error(exc)
        loc = ".".join(str(p) for p in first.get("loc", ())) or where
        raise bad_request(loc, first.get("msg", "invalid")) from None


def _query(request: Request, model: type[BaseModel]):
    return _parse(model, dict(request.query_params))


def _cursor(page: Page, total: int) -> dict:
    return {"offset": page.offset, "limit": page.limit, "total_count": total}


# --- training runs -----------------------------------------------------------------------------------------

def run_id_of(state: TinkerState, tenant: str, given: str) -> str:
    """A training run id as the client names it: the run of a ``tinker://<run>/...`` path, or a model id
    (``<session>:train:<n>``)."""
    model = state.models.get(given)
    if model is not None and model.tenant == tenant:
        return model.run_id
    if not RUN_RE.fullmatch(given):
        raise not_found("training_run", given)
    return given


def _run_record(state: TinkerState, tenant: str, run_id: str,
                checkpoints: list[tuple[CheckpointRef, dict, int]]) -> dict | None:
    """The run's record from its live state and its checkpoints (newest metadata first), or None if unknown."""
    try:
        live = state.service.runs.get(run_id, tenant)
    except WorkerError:
        live = None
    if live is None and not checkpoints:
        return None
    newest = max(checkpoints, key=lambda c: c[1].get("created_at", 0.0))[1] if checkpoints else {}
    model = next((m for m in state.models.values() if m.run_id == run_id and m.tenant == tenant), None)
    if live is not None:
        base_model, rank, labels = live.base_model, live.spec.rank, live.user_metadata
    else:
        base_model, rank, labels = newest["base_model"], newest["lora"]["rank"], newest.get("run_user_metadata")
    last = model.last_request if model is not None else newest.get("created_at", time.time())
    return records.training_run_record(run_id, tenant, base_model, rank, last, labels, checkpoints)


async def get_training_run(state: TinkerState, request: Request, tenant: str):
    _query(request, ScopeQuery)
    run_id = run_id_of(state, tenant, request.path_params["run_id"])
    checkpoints = await asyncio.to_thread(state.service.checkpoints.records, tenant, run_id)
    record = _run_record(state, tenant, run_id, checkpoints)
    if record is None:
        raise not_found("training_run", request.path_params["run_id"])
    return record


def all_runs(state: TinkerState, tenant: str) -> list[dict]:
    """Every training run of this key, most recently used first (reads checkpoint metadata: in a thread)."""
    by_run: dict[str, list] = {run.run_id: [] for run in state.service.runs.owned(tenant)}
    for ref, meta, size in state.service.checkpoints.records(tenant):
        by_run.setdefault(ref.run_id, []).append((ref, meta, size))
    runs = [r for r in (_run_record(state, tenant, run_id, cks) for run_id, cks in by_run.items()) if r]
    return sorted(runs, key=lambda r: (r["last_request_time"], r["training_run_id"]), reverse=True)


async def list_training_runs(state: TinkerState, request: Request, tenant: str):
    page = _query(request, RunsPage)
    if page.project_id is not None:
        raise bad_request("project_id", "projects are a feature of the hosted Tinker service; this worker has none "
                                        "(leave project_id unset)")
    runs = await asyncio.to_thread(all_runs, state, tenant)
    return {"training_runs": runs[page.offset:page.offset + page.limit], "cursor": _cursor(page, len(runs))}


# --- checkpoints -------------------------------------------------------------------------------------------

def _newest_first(checkpoints: list[tuple[CheckpointRef, dict, int]]) -> list[dict]:
    ordered = sorted(checkpoints, key=lambda c: (c[1].get("created_at", 0.0), c[0].path), reverse=True)
    return [records.checkpoint_record(ref, meta, size) for ref, meta, size in ordered]


async def list_run_checkpoints(state: TinkerState, request: Request, tenant: str):
    run_id = run_id_of(state, tenant, request.path_params["run_id"])
    checkpoints = await asyncio.to_thread(state.service.checkpoints.records, tenant, run_id)
    if not checkpoints and _run_record(state, tenant, run_id, []) is None:
        raise not_found("training_run", request.path_params["run_id"])
    listed = _newest_first(checkpoints)
    return {"checkpoints": listed, "cursor": {"offset": 0, "limit": len(listed), "total_count": len(listed)}}


async def list_user_checkpoints(state: TinkerState, request: Request, tenant: str):
    page = _parse(Page, {"limit": 100, **dict(request.query_params)})
    listed = _newest_first(await asyncio.to_thread(state.service.checkpoints.records, tenant))
    return {"checkpoints": listed[page.offset:page.offset + page.limit], "cursor": _cursor(page, len(listed))}


def checkpoint_path(state: TinkerState, tenant: str, request: Request) -> str:
    """The worker's path of ``/training_runs/{run_id}/checkpoints/{kind}/{name}`` (kind as in tinker:// paths)."""
    params = request.path_params
    kind = records.TINKER_KINDS.get(params["kind"])
    if kind is None:
        raise bad_request("checkpoint_id", f"{params['kind']}/{params['name']}: the kind must be one of "
                                           f"{', '.join(records.TINKER_KINDS)}")
    return f"trio://{run_id_of(state, tenant, params['run_id'])}/{kind}/{params['name']}"


async def delete_checkpoint(state: TinkerState, request: Request, tenant: str):
    path = checkpoint_path(state, tenant, request)
    await asyncio.to_thread(state.service.checkpoints.delete, path, tenant)
    return {}


async def set_checkpoint_ttl(state: TinkerState, request: Request, tenant: str):
    path = checkpoint_path(state, tenant, request)
    body = _parse(TtlBody, await read_json(request, state.json_limit), "body")
    when = None if body.ttl_seconds is None else time.time() + body.ttl_seconds
    await asyncio.to_thread(state.service.checkpoints.set_expiry, path, tenant, when)
    return {}


async def publish(state: TinkerState, request: Request, tenant: str):
    path = checkpoint_path(state, tenant, request)
    await asyncio.to_thread(state.service.checkpoints.owned_ref, path, tenant, "path")  # 404 if not yours
    raise bad_request("checkpoint_id", "publishing is not supported by this worker: a checkpoint is visible to "
                                       "its API key only (share the PEFT folder under --storage, or the key)",
                      code="not_supported")


# --- sessions ------------------------------------------------------------------------------------------------

def _owned_sessions(state: TinkerState, tenant: str) -> list:
    sessions = [s for s in state.sessions.values() if s.tenant == tenant]
    return sorted(sessions, key=lambda s: (s.created, s.session_id), reverse=True)


async def list_sessions(state: TinkerState, request: Request, tenant: str):
    page = _query(request, Page)
    sessions = _owned_sessions(state, tenant)
    return {"sessions": [s.session_id for s in sessions[page.offset:page.offset + page.limit]]}


async def get_session(state: TinkerState, request: Request, tenant: str):
    _query(request, ScopeQuery)
    session = state.sessions.get(request.path_params["session_id"])
    if session is None or session.tenant != tenant:
        raise not_found("session", request.path_params["session_id"])
    return {"training_run_ids": state.session_runs(session.session_id),
            "sampler_ids": state.session_samplers(session.session_id),
            "user_metadata": session.user_metadata, "display_name": session.display_name}


def _matches(session, query: SessionSearch) -> bool:
    by_id = query.session_id is not None and session.session_id == query.session_id
    name = (session.display_name or "").lower()
    by_name = query.display_name is not None and all(w in name for w in query.display_name.lower().split())
    if (query.session_id is not None or query.display_name is not None) and not (by_id or by_name):
        return False
    labels = session.user_metadata or {}
    if any(labels.get(k) != v for k, v in query.user_metadata.items()):
        return False
    return query.statuses is None or any(s.get("type") == "active" for s in query.statuses)


def _summary(state: TinkerState, session) -> dict:
    runs = set(state.session_runs(session.session_id))
    checkpoints = [c for c in state.service.checkpoints.records(session.tenant) if c[0].run_id in runs]
    return {"session_id": session.session_id, "created_at": records.iso(session.created),
            "owner": records.owner_label(session.tenant), "project_id": "", "status": {"type": "active"},
            "checkpoints_count": len(checkpoints), "display_name": session.display_name,
            "user_metadata": session.user_metadata, "checkpoint_storage_bytes": sum(c[2] for c in checkpoints)}


async def search_sessions(state: TinkerState, request: Request, tenant: str):
    query = _parse(SessionSearch, await read_json(request, state.json_limit), "body")
    if query.project_ids is not None:
        raise bad_request("project_ids", "projects are a feature of the hosted Tinker service; leave it unset")
    if query.owner.get("type", "own") != "own":
        raise bad_request("owner", "this worker searches the caller's own sessions only")
    found = [s for s in _owned_sessions(state, tenant) if _matches(s, query)]
    if query.cursor is not None:
        after = (query.cursor.last_created_at.timestamp(), query.cursor.last_session_id)
        found = [s for s in found if (s.created, s.session_id) < after]
    page = found[:query.limit]
    summaries = await asyncio.to_thread(lambda: [_summary(state, s) for s in page])
    more = len(found) > query.limit
    last = page[-1] if page else None
    cursor = {"last_created_at": records.iso(last.created), "last_session_id": last.session_id} if more else None
    return {"sessions": summaries, "next_cursor": cursor}


# --- hosted-only ---------------------------------------------------------------------------------------------

HOSTED_ONLY = {
    "assign_session_project": "projects are a feature of the hosted Tinker service",
    "copy_weights": "copies between projects are a feature of the hosted Tinker service (a checkpoint here is "
                    "already a PEFT folder under --storage)",
    "audit": "the audit log is a feature of the hosted Tinker service",
    "billing": "billing and usage reports are features of the hosted Tinker service",
}


def hosted_only(feature: str):
    async def refuse(state: TinkerState, request: Request, tenant: str):
        raise WorkerError(400, "not_supported", f"{request.url.path} is not supported by this worker: "
                                                f"{HOSTED_ONLY[feature]}")

    refuse.__name__ = feature
    return refuse


async def export_session_trace(state: TinkerState, request: Request, tenant: str):
    """Answered as a failed export job, so the SDK raises at once with the reason instead of polling."""
    session = state.sessions.get(request.path_params["session_id"])
    if session is None or session.tenant != tenant:
        raise not_found("session", request.path_params["session_id"])
    return {"status": "failed", "error": "trace export (Perfetto traces of a session's requests) is a feature of "
                                         "the hosted Tinker service; this worker keeps no request traces"}


ROUTES = [  # (path under /api/v1, handler, methods): more specific paths first
    ("/training_runs", list_training_runs, ("GET",)),
    ("/training_runs/{run_id}/checkpoints", list_run_checkpoints, ("GET",)),
    ("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", set_checkpoint_ttl, ("PUT",)),
    ("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", publish, ("POST", "DELETE")),
    ("/training_runs/{run_id}/checkpoints/{kind}/{name}", delete_checkpoint, ("DELETE",)),
    ("/training_runs/{run_id}", get_training_run, ("GET",)),
    ("/checkpoints", list_user_checkpoints, ("GET",)),
    ("/sessions", list_sessions, ("GET",)),
    ("/sessions/search", search_sessions, ("POST",)),
    ("/sessions/{session_id}/project", hosted_only("assign_session_project"), ("PUT",)),
    ("/sessions/{session_id}/trace_export", export_session_trace, ("GET",)),
    ("/sessions/{session_id}", get_session, ("GET",)),
    ("/copy_weights", hosted_only("copy_weights"), ("POST",)),
    ("/audit", hosted_only("audit"), ("GET",)),
    ("/billing/{rest:path}", hosted_only("billing"), ("GET",)),
]
