"""The Tinker HTTP API (``/api/v1/...``) on top of the worker's own service, for the official ``tinker`` SDK.

Everything here translates: Tinker requests become the service's ops, samplers and checkpoints, and the
service's results become Tinker's answers (JSON, or protobuf for forward/backward and sampling results, see
proto/). Models, adapters, request queues and checkpoints are the service's, so a run started through one
protocol shares the worker with the others. See docs/tinker.md.

The routes live with their resource: sessions (sessions and training models), training (forward/backward,
optimizer steps), weights (save, load, describe), sampling (sampling sessions, asample), futures
(retrieve_future), rest (training runs, checkpoints and sessions for ``RestClient``; records builds its
answers) and export (external weights and checkpoint archives, served through api/downloads.py). state holds
what they share, gate the per-model seq_id ordering (holding bounds what waiting requests keep) and submit the
hand-over to the service in that order, provenance the records behind stable_reinforce, endpoint the HTTP
plumbing, paths the tinker:// names. The bounds are listed in docs/reliability.md ("Tinker protocol hardening").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.routing import Route

from server_mock.api.downloads import Downloads
from server_mock.api.tinker import restart, rest, sampling, sessions, training, weights
from server_mock.api.tinker.endpoint import JSON, PROTOBUF, endpoint, tenant_of
from server_mock.api.tinker.export import Export
from server_mock.api.tinker.futures import retrieve_future
from server_mock.api.tinker.paths import tinker_message, tinker_metrics, to_tinker_path, to_trio_path
from server_mock.api.tinker.state import TinkerState
from server_mock.config import TinkerOptions
from server_mock.errors import WorkerError

__all__ = ["TinkerProtocol", "tinker_message", "tinker_metrics", "to_tinker_path", "to_trio_path"]


async def unsupported(state: TinkerState, request: Request, tenant: str):
    raise WorkerError(404, "not_supported", f"{request.method} {request.url.path} is not supported by this "
                                            "worker (see docs/tinker.md for the Tinker endpoints it serves)")


def _session_scopes(state: TinkerState, session_id: str) -> list[str] | None:
    """A session's training runs and samplers (the operator's session trace), None if unknown."""
    if state.sessions.get(session_id) is None:
        return None
    return [*state.session_runs(session_id), *state.session_samplers(session_id)]


class TinkerProtocol:
    """The protocol as a front end (api/lifecycle.py): its state, its routes, its records taken up again at start,
    and the sweep that finishes the sessions whose client went away."""

    name = "tinker"
    sweep_seconds = 5.0  # how often sessions without heartbeats are looked for (they expire after their TTL)

    def __init__(self, service, auth, downloads: Downloads | None = None, options: TinkerOptions | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.state = TinkerState(service, options, clock)
        service.usage.traces.sessions.append(functools.partial(_session_scopes, self.state))  # operator's traces
        self.auth = auth
        self.downloads = downloads or Downloads(service.limits.download_url_seconds)

    def routes(self) -> list[Route]:
        return _routes(self.state, self.auth, self.downloads)

    async def restore(self) -> dict[str, int]:
        """Sessions, models, gates and futures, from the journal (``--durability full``)."""
        return await restart.restore(self.state)

    async def sweep(self) -> None:
        """Finish the sessions idle past --tinker-session-ttl, by the clock: no client request is needed."""
        await self.state.expire()


def _routes(state: TinkerState, auth, downloads: Downloads) -> list[Route]:
    downloads.recognize(lambda request: tenant_of(auth, request))
    export = Export(state, downloads)
    checkpoint = "/training_runs/{run}/checkpoints"

    def route(path: str, handler, methods=("POST",), public: bool = False, media=(JSON,)) -> Route:
        return Route("/api/v1" + path, endpoint(handler, state, auth, public, media), methods=list(methods))

    return [
        route("/client/config", sessions.client_config),
        route("/client/dynamic_config", sessions.dynamic_config),
        route("/create_session", sessions.create_session),
        route("/session_heartbeat", sessions.heartbeat),
        route("/telemetry", sessions.telemetry),
        route("/sessions/{session_id}/finish", sessions.finish_session),
        route("/get_server_capabilities", sessions.capabilities, methods=("GET",)),
        route("/healthz", sessions.healthz, methods=("GET",), public=True),
        route("/create_model", sessions.create_model),
        route("/get_info", sessions.get_info),
        route("/forward_backward", training.forward_backward, media=(PROTOBUF,)),
        route("/optim_step", training.optim_step),
        route("/save_weights", weights.save_weights),
        route("/save_weights_for_sampler", weights.save_weights_for_sampler),
        route("/load_weights", weights.load_weights),
        route("/weights_info", weights.weights_info),
        route("/create_sampling_session", sampling.create_sampling_session),
        route("/samplers/{sampler_id}", sampling.get_sampler, methods=("GET",)),
        route("/asample", sampling.asample),
        route("/retrieve_future", retrieve_future),
        route("/save_weights_external", export.save_weights_external),
        route(checkpoint + "/external_weights/{name}/external_weights_urls", export.external_weights_urls,
              methods=("GET",)),
        route(checkpoint + "/external_weights/{name}/ttl", export.set_ttl, methods=("PUT",)),
        route(checkpoint + "/external_weights/{name}", export.delete, methods=("DELETE",)),
        route(checkpoint + "/{kind}/{name}/archive", export.archive, methods=("GET",)),
        *(route(path, handler, methods=methods) for path, handler, methods in rest.ROUTES),
        route("/{rest:path}", unsupported, methods=("GET", "POST", "PUT", "PATCH", "DELETE")),
    ]
