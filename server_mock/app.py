"""The worker's HTTP app: the four protocols' routes, shared state, the browser guard and the background sweepers.

Each protocol is a package under server_mock/api/: native (/v1), tinker (/api/v1), openai (/api/openai/v1) and
pytrio (/api/openapi/v1, /api/models, /api/sdk, /api/telemetry and /pytrio-actor/v1, for the official pytrio SDK),
all over the one ``WorkerService``. Another route list is mounted by passing it as ``extra_routes``. Signed
download URLs of every protocol are served by one ``Downloads`` (api/downloads.py, ``app.state.downloads``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from server_mock.api.auth import Auth
from server_mock.api.bodies import ParseBudget
from server_mock.api.body_budget import BodyBudget
from server_mock.api.browser_safety import BrowserGuard, HostPolicy
from server_mock.api.long_polls import LongPolls
from server_mock.api.downloads import ARCHIVE, Downloads, archive_resolver
from server_mock.api.lifecycle import FrontEnd, sweep_forever
from server_mock.api.native import native_routes
from server_mock.api.native.endpoint import Idempotency
from server_mock.api.openai.router import openai_routes
from server_mock.api.pytrio import PytrioProtocol
from server_mock.api.tinker.router import TinkerProtocol
from server_mock.config import PytrioOptions, TinkerOptions
from server_mock.operator import CountAnswers, operator_routes
from server_mock.service.recovery import recover
from server_mock.service.worker import WorkerService


def create_app(service: WorkerService, api_keys: list[str] | None = None, *, bind_host: str = "127.0.0.1",
               allowed_hosts: Iterable[str] = (), extra_routes: Iterable[BaseRoute] = (),
               pytrio_options: PytrioOptions | None = None, admin_keys: Iterable[str] = (),
               tinker_options: TinkerOptions | None = None) -> Starlette:
    auth = Auth(api_keys or [], admin_keys)
    downloads = Downloads(default_ttl=service.limits.download_url_seconds)
    downloads.register(ARCHIVE, archive_resolver(service.checkpoints))
    pytrio = PytrioProtocol(service, auth, pytrio_options, downloads)
    tinker = TinkerProtocol(service, auth, downloads, tinker_options)
    fronts: list[FrontEnd] = [tinker, pytrio]  # front ends with state of their own: one lifecycle for all
    if service.journal is not None:  # --durability full: each takes up its records after the service's recovery
        service.recovery_hooks.extend(front.restore for front in fronts)
    routes = [*native_routes(), *extra_routes, *downloads.routes(), *tinker.routes(), *openai_routes(service, auth),
              *pytrio.routes(), *operator_routes(service, auth)]
    service.usage.traces.sessions.append(pytrio.session_scopes)  # a PyTRIO session's runs' and samplers' ops

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        app.state.recovered = await recover(service)  # before the first request: what a crash left is taken up
        tasks = [asyncio.create_task(_sweep(service)),
                 *(asyncio.create_task(sweep_forever(front)) for front in fronts)]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            service.stop()

    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(CountAnswers, counter=service.usage.metrics.requests),
                                Middleware(BrowserGuard, policy=HostPolicy(bind_host, list(allowed_hosts)))])
    app.state.service = service
    app.state.auth = auth
    app.state.downloads = downloads
    app.state.idempotency = Idempotency()
    app.state.parse_budget = ParseBudget(service.limits.max_parsing_bytes)
    app.state.body_budget = BodyBudget(service.limits.max_body_bytes_in_flight,
                                       service.limits.max_body_bytes_in_flight_per_tenant)
    app.state.long_polls = LongPolls(service.limits.max_long_polls_per_tenant)
    app.state.fronts = {front.name: front for front in fronts}
    app.state.pytrio = pytrio
    app.state.tinker = tinker
    return app


async def _sweep(service: WorkerService) -> None:
    """Drop expired results (within 1.5 x the TTL) and, every --checkpoint-sweep-seconds (a minute), expired
    checkpoints on disk."""
    disk_every = service.limits.checkpoint_sweep_seconds
    sweep_every = max(0.05, min(60.0, service.requests.result_ttl / 2, disk_every))
    loop = asyncio.get_running_loop()
    last_disk_sweep = loop.time()
    while True:
        await asyncio.sleep(sweep_every)
        service.requests.sweep()
        if service.journal is not None:
            await asyncio.to_thread(service.journal.sweep)
        if loop.time() - last_disk_sweep >= disk_every:
            last_disk_sweep = loop.time()
            await asyncio.to_thread(service.checkpoints.sweep)
