"""The PyTRIO protocol, for the official, unmodified ``pytrio`` SDK (0.2.9): its Control plane under ``/api/...``
and its Actor plane under ``/pytrio-actor/v1/...``, on the worker's own port, over the worker's own service.

A PyTRIO user points the SDK at the worker with ``PYTRIO_BASE_URL`` and ``PYTRIO_API_KEY`` and changes nothing
else. Control (JSON, the API key) creates service sessions and runs and hands out, per run, an Actor endpoint and
an actor token; the Actor plane (the token) takes the training events (msgpack) and sample requests. The events
become the service's ops, in order, on the same tenant lanes, limits, losses and checkpoints as the native,
Tinker and OpenAI protocols. docs/pytrio.md lists every route, what is refused, the reduction and the tokens.

Modules: control_wire / event_wire / sample_wire (the shapes), msgpack_codec (bounded decoding), endpoint (HTTP
plumbing), tokens, state (sessions, runs, their release), durable / restart (their records under
``--durability full``, taken up again at start), events (a run's event table and order), training (how an event
runs), control / runs / checkpoints / downloads (Control routes), actor / sampling (Actor routes).
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.routing import Route

from server_mock.api.auth import Auth
from server_mock.api.downloads import Downloads as SignedDownloads
from server_mock.api.pytrio import actor, checkpoints, control, downloads, restart, runs, sampling
from server_mock.api.pytrio.endpoint import actor_endpoint, control_endpoint
from server_mock.api.pytrio.msgpack_codec import MEDIA_TYPE
from server_mock.api.pytrio.state import PytrioState
from server_mock.config import PytrioOptions
from server_mock.errors import WorkerError
from server_mock.service.worker import WorkerService

logger = logging.getLogger("server_mock")

OPENAPI = "/api/openapi/v1"
ACTOR = runs.ACTOR_PREFIX + "/v1"
ANY = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"]


async def _unknown(state, request: Request, tenant: str = ""):
    raise WorkerError(404, "not_found", f"{request.method} {request.url.path} is not a PyTRIO route this worker "
                                        "serves (see docs/pytrio.md)")


async def _unknown_actor(state, request: Request):
    return await _unknown(state, request)


class PytrioProtocol:
    """The protocol as a front end (api/lifecycle.py): its state, its routes, its records taken up again at start,
    and the sweep that releases what expired."""

    name = "pytrio"
    sweep_seconds = 5.0

    def __init__(self, service: WorkerService, auth: Auth, options: PytrioOptions | None = None,
                 links: SignedDownloads | None = None) -> None:
        self.state = PytrioState(service, options or PytrioOptions())
        self.auth = auth
        self.downloads = downloads.Downloads(service, links)

    def routes(self) -> list[Route]:
        state, auth = self.state, self.auth

        def c(path: str, handler, methods=("GET",), prefix: str = OPENAPI) -> Route:
            return Route(prefix + path, control_endpoint(handler, state, auth), methods=list(methods))

        def a(path: str, handler, methods=("POST",), media=("application/json",), prefix: str = ACTOR) -> Route:
            return Route(prefix + path, actor_endpoint(handler, state, media), methods=list(methods))

        link = self.downloads
        return [
            c("/api-key/verify", control.verify_api_key),
            c("/service-sessions", control.create_session, ("POST",)),
            c("/service-sessions", control.list_sessions),
            c("/service-sessions/{session}", control.get_session),
            c("/service-sessions/{session}/close", control.close_session, ("POST",)),
            c("/service-sessions/{session}/renew", control.renew_session, ("POST",)),
            c("/service-sessions/{session}/training-runs", runs.create_training_run, ("POST",)),
            c("/service-sessions/{session}/training-runs/{run}", runs.update_training_run, ("PATCH",)),
            c("/service-sessions/{session}/sampling-runs", runs.create_sampling_run, ("POST",)),
            c("/training-runs/by-checkpoint-uri", checkpoints.checkpoint_config),
            c("/training-runs", runs.list_training_runs),
            c("/training-runs/{run}", runs.get_training_run),
            c("/training-runs/{run}/renew", runs.renew_training_run, ("POST",)),
            c("/training-runs/{run}/checkpoints", checkpoints.list_run_checkpoints),
            c("/sampling-runs/{run}", runs.get_sampling_run),
            c("/sampling-runs/{run}/renew", runs.renew_sampling_run, ("POST",)),
            c("/checkpoints", checkpoints.list_checkpoints),
            c("/checkpoints/{checkpoint}/download-url", link.download_url),
            c("/checkpoints/{checkpoint}", link.delete_checkpoint, ("DELETE",)),
            c("/{rest:path}", _unknown, ANY),
            c("/api/models", control.list_models, prefix=""),
            c("/api/sdk/bootstrap", control.bootstrap, prefix=""),
            c("/api/sdk/{rest:path}", _unknown, ANY, prefix=""),
            c("/api/telemetry/event", control.telemetry, ("POST",), prefix=""),
            a("/events", actor.submit_event, media=(MEDIA_TYPE,)),
            a("/events/{event_id}", actor.get_event, ("GET",)),
            a("/client/heartbeat", actor.heartbeat),
            a("/sampling-runs/{run}/sample", sampling.sample),
            a("/{rest:path}", _unknown_actor, ANY, prefix=runs.ACTOR_PREFIX),
        ]

    def session_scopes(self, session_cuid: str) -> list[str] | None:
        """The service runs and samplers of a service session (the operator's session trace), None if unknown."""
        session = self.state.sessions.get(session_cuid)
        if session is None:
            return None
        return [*self.state.training_cuids(session), *(run.sampler_id for run in self.state.sampling_of(session))]

    async def restore(self) -> dict[str, int]:
        """Sessions, runs, tokens and events, from the journal (``--durability full``)."""
        return await restart.restore(self.state)

    async def sweep(self) -> None:
        await self.state.sweep()
