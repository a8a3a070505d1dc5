"""What a front end with state of its own offers the app, whatever its protocol: its routes, taking its records
up again after a restart (on top of the service's recovery), and a periodic sweep of what expired by the clock
(idle sessions, released runs, old answers). ``create_app`` wires every front end the same way
(``restore`` as a recovery hook under ``--durability full``, ``sweep_forever`` while it serves)."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from starlette.routing import BaseRoute

logger = logging.getLogger("server_mock")


class FrontEnd(Protocol):
    name: str
    sweep_seconds: float  # how often ``sweep`` runs

    def routes(self) -> list[BaseRoute]: ...

    async def restore(self) -> dict[str, int]:
        """Its state rebuilt from the journal, after the service's own recovery; how many of each came back."""

    async def sweep(self) -> None:
        """Release what expired, by the clock."""


async def sweep_forever(front: FrontEnd) -> None:
    """``front.sweep()`` every ``front.sweep_seconds`` until cancelled; a failed sweep is logged and tried again."""
    while True:
        await asyncio.sleep(front.sweep_seconds)
        try:
            await front.sweep()
        except Exception:  # noqa: BLE001 - the next sweep tries again
            logger.exception("%s: sweep failed", front.name)
