"""ASGI middleware: every HTTP answer counted by protocol and status (``pytrio_worker_requests_total``), the
browser guard's refusals included (it sits inside this one)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# path prefixes, longest first: each front end's routes (docs/architecture.md)
PROTOCOLS = (("/api/openai/", "openai"), ("/api/v1/", "tinker"), ("/api/", "pytrio"), ("/pytrio-actor/", "pytrio"),
             ("/v1/", "native"), ("/downloads/", "downloads"), ("/metrics", "operator"), ("/console", "operator"),
             ("/operator/", "operator"))


def protocol_of(path: str) -> str:
    for prefix, name in PROTOCOLS:
        if path.startswith(prefix):
            return name
    return "other"


class CountAnswers:
    def __init__(self, app: ASGIApp, counter) -> None:
        self.app = app
        self.counter = counter  # a prometheus Counter with labels (protocol, code)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        protocol = protocol_of(scope.get("path", ""))

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(protocol, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
