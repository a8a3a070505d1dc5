"""Control routes for who the caller is and their sessions: API-key verification, the SDK bootstrap, the model
catalog, service sessions (create, get, list, renew, close) and telemetry. Each handler is
``(state, request, tenant)``; the run and checkpoint routes are in runs.py and checkpoints.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from starlette.requests import Request

from server_mock.api import bodies
from server_mock.api.pytrio import control_wire as cw
from server_mock.api.pytrio.endpoint import CONTROL_BODY_BYTES, no_content, query, read_model
from server_mock.api.pytrio.models import catalog_item
from server_mock.api.pytrio.state import PytrioState, Session, workspace_of

T = TypeVar("T")


def page(items: Sequence[T], request: Request) -> tuple[Sequence[T], cw.CursorOut]:
    """One page of ``items`` by the request's limit/offset, and its cursor (``limit``: the rows served, or the one
    asked for when there are none, never 0: the SDK pages on offset + limit < total)."""
    asked = query(request, cw.PageIn)
    rows = items[asked.offset:asked.offset + asked.limit]
    return rows, cw.CursorOut(offset=asked.offset, limit=len(rows) or asked.limit, total=len(items))


async def verify_api_key(state: PytrioState, request: Request, tenant: str):
    workspace = workspace_of(tenant)
    return cw.ApiKeyInfoOut(api_key_tid="key_" + workspace[3:], user_cuid=workspace, username="local",
                            workspace_cuid=workspace, workspace_name="local", workspace_type="personal")


async def bootstrap(state: PytrioState, request: Request, tenant: str):
    version = request.query_params.get("sdk_version", "")[:cw.MAX_SHORT]
    return cw.BootstrapOut(compatibility=cw.CompatibilityOut(status="compatible", sdk_version=version))


async def list_models(state: PytrioState, request: Request, tenant: str):
    models = state.service.models
    aliases = sorted(set(models.sources) | set(models.hosts))
    rows, cursor = page(aliases, request)
    return cw.ModelListOut(items=[catalog_item(state, alias) for alias in rows], total=cursor.total,
                           limit=len(rows), offset=cursor.offset)


async def telemetry(state: PytrioState, request: Request, tenant: str):
    await bodies.read_body(request, CONTROL_BODY_BYTES)  # read within its limit, then dropped unread
    return no_content()


# --- service sessions ---------------------------------------------------------------------------------------------


def session_out(state: PytrioState, session: Session, with_runs: bool) -> cw.ServiceSessionOut:
    return cw.ServiceSessionOut(
        service_session_cuid=session.cuid, workspace_cuid=workspace_of(session.tenant), status=session.status,
        sdk_version=session.sdk_version or None, created_at=cw.utc(session.created),
        updated_at=cw.utc(session.last_seen),
        training_run_cuids=state.training_cuids(session) if with_runs else None,
        sampling_run_cuids=state.sampling_cuids(session) if with_runs else None)


async def create_session(state: PytrioState, request: Request, tenant: str):
    body = await read_model(request, cw.ServiceSessionCreateIn)
    session = state.new_session(tenant, body.sdk_version)
    return cw.ServiceSessionCreatedOut(service_session_cuid=session.cuid, workspace_cuid=workspace_of(tenant),
                                       status=session.status, created_at=cw.utc(session.created))


async def get_session(state: PytrioState, request: Request, tenant: str):
    return session_out(state, state.session(request.path_params["session"], tenant), with_runs=True)


async def list_sessions(state: PytrioState, request: Request, tenant: str):
    rows, cursor = page(state.sessions_of(tenant), request)
    items = [session_out(state, s, with_runs=False).model_dump(mode="json", exclude_none=True) for s in rows]
    return {"service_sessions": items, "cursor": cursor.model_dump()}


async def renew_session(state: PytrioState, request: Request, tenant: str):
    session = state.session(request.path_params["session"], tenant)
    return {"service_session_cuid": session.cuid, "workspace_cuid": workspace_of(tenant), "status": session.status,
            "updated_at": cw.utc(session.last_seen).isoformat().replace("+00:00", "Z")}


async def close_session(state: PytrioState, request: Request, tenant: str):
    body = await read_model(request, cw.ServiceSessionCloseIn)
    session = state.session(request.path_params["session"], tenant)
    # answered at once: the SDK sends this at interpreter exit and waits for it
    state.spawn(state.close_session(session, body.status), f"closing session {session.cuid}")
    return no_content()
