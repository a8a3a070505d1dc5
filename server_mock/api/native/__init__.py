"""The native HTTP API (/v1), one module per resource. Each module's ``ROUTES`` is a list of Starlette
routes whose handlers are module-level functions reaching the service through ``request.app.state``."""

from __future__ import annotations

from starlette.routing import BaseRoute

from server_mock.api.native import checkpoints, health, requests, runs, samplers


def native_routes() -> list[BaseRoute]:
    return [*health.ROUTES, *runs.ROUTES, *samplers.ROUTES, *checkpoints.ROUTES, *requests.ROUTES]
