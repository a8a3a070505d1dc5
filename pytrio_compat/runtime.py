"""The async core: one event loop on a daemon thread, one httpx.AsyncClient, retries and long polls.

Every public call, sync or async, ends up as a coroutine on this loop. The sync API blocks on a
``concurrent.futures.Future``; the async API awaits the same future from the caller's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
import uuid
from typing import Any, Coroutine, TypeVar

import httpx
from pydantic import BaseModel

from .config import Configuration
from .errors import (
    RETRYABLE_STATUSES,
    APIError,
    AuthError,
    ConnectionFailedError,
    EventFailedError,
    RequestLostError,
    ValidationError,
)
from .wire import ErrorResponse, RequestStatus

T = TypeVar("T")
logger = logging.getLogger("pytrio_compat")

_RETRYABLE_EXCEPTIONS = (
    httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError,
    httpx.PoolTimeout, httpx.TimeoutException,
)


class Runtime:
    def __init__(self, base_url: str, api_key: str, config: Configuration,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._transport = transport  # tests inject faults here
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pytrio-compat-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self.http: httpx.AsyncClient = self.run(self._make_http())

    async def _make_http(self) -> httpx.AsyncClient:
        headers = {"User-Agent": "pytrio_compat/0.1"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
            headers["X-API-Key"] = self.api_key
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits, timeout=None,
                                 transport=self._transport)

    # --- bridging sync and async ---------------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future:
        if self._closed:
            coro.close()
            raise RuntimeError("this client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("sync pytrio_compat calls cannot run on the SDK's own event loop thread")
        return self.submit(coro).result(timeout)

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await a coroutine that must run on the runtime loop, from any other loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.run(self.http.aclose(), timeout=5)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    # --- HTTP with retries ------------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | dict | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        retry_window: float | None = None,
        operation: str | None = None,
        idempotent: bool = True,
        max_attempts: int | None = None,
    ) -> Any:
        """Send one request, retrying connection errors and 408/429/5xx with backoff inside a window.

        Non-idempotent creations carry an Idempotency-Key so a resent request is answered, not redone.
        ``max_attempts`` (downloads) also stops after that many attempts, inside the window; a connection that
        cannot be made (the worker is not listening, e.g. while it restarts) is not an attempt."""
        cfg = self.config
        window = cfg.control_retry_timeout_seconds if retry_window is None else retry_window
        content = None
        headers = {}
        if body is not None:
            content = body.model_dump_json() if isinstance(body, BaseModel) else httpx.Request(
                "POST", "/", json=body).content
            headers["Content-Type"] = "application/json"
        if not idempotent:
            headers["Idempotency-Key"] = uuid.uuid4().hex
        op = operation or f"{method} {path}"
        delay = cfg.retry_initial_delay_seconds
        deadline: float | None = None
        told_about_limit = False
        attempts = 0
        while True:
            try:
                response = await self.http.request(
                    method, path, content=content, params=params, headers=headers,
                    timeout=timeout or cfg.request_timeout_seconds,
                )
                attempts += 1
                if response.status_code < 400:
                    return response.json()
                error = _error_from_response(response, op)
                if response.status_code not in RETRYABLE_STATUSES:
                    raise error
                last: Exception = error
                retry_after = _retry_after(response)
                if response.status_code == 429 and not told_about_limit:
                    told_about_limit = True  # say once why the call is waiting, then keep retrying quietly
                    logger.warning("%s is waiting: %s (retrying for up to %.0fs)", op,
                                   getattr(error, "message", error), window)
            except _RETRYABLE_EXCEPTIONS as exc:
                # a connection that could not be made reached no worker (one restarting): only the window ends that
                attempts += not isinstance(exc, httpx.ConnectError)
                last = ConnectionFailedError(
                    f"could not reach the worker at {self.base_url}: {type(exc).__name__}: {exc}",
                    hint="check that the worker is running and the base URL is right",
                    operation=op, retryable=True,
                )
                retry_after = None
            now = time.monotonic()
            if deadline is None:
                deadline = now + window
            if now >= deadline or (max_attempts is not None and attempts >= max_attempts):
                raise last
            sleep = retry_after if retry_after is not None else delay * (1 + random.uniform(0, cfg.retry_jitter_ratio))
            sleep = min(sleep, max(0.0, deadline - now))
            logger.debug("retrying %s in %.2fs after: %s", op, sleep, last)
            await asyncio.sleep(sleep)
            delay = min(delay * cfg.retry_multiplier, cfg.retry_max_delay_seconds)

    async def wait_for_request(self, request_id: str, operation: str, retry_window: float | None = None) -> dict:
        """Long-poll a queued request until it finishes; return its result or raise its error."""
        poll = self.config.actor_event_polling_timeout_seconds
        while True:
            try:
                raw = await self.request(
                    "GET", f"/v1/requests/{request_id}", params={"wait": poll}, timeout=poll + 30,
                    retry_window=retry_window, operation=operation,
                )
            except APIError as exc:
                if exc.status_code == 404:
                    raise RequestLostError(
                        f"the worker no longer knows request {request_id} ({operation})",
                        hint="the worker was restarted or the result expired; resubmit the call",
                        request_id=request_id, operation=operation, status_code=404,
                    ) from exc
                if isinstance(exc, ConnectionFailedError):
                    raise ConnectionFailedError(
                        f"lost contact with the worker while waiting for request {request_id} ({operation}): "
                        f"{exc.message}", hint="check the worker; if it restarted, the request is gone: resubmit it",
                        request_id=request_id, operation=operation, retryable=True,
                    ) from exc
                raise
            status = RequestStatus.model_validate(raw)
            if status.status == "succeeded":
                return status.result or {}
            if status.status == "failed":
                err = status.error
                raise EventFailedError(
                    err.message if err else "request failed", code=err.code if err else None,
                    request_id=request_id, operation=operation,
                    details={"field": err.field} if err and err.field else None,
                )


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _error_from_response(response: httpx.Response, operation: str) -> Exception:
    status = response.status_code
    try:
        body = ErrorResponse.model_validate(response.json()).error
        code, message, field, details = body.code, body.message, body.field, body.details
    except Exception:  # noqa: BLE001 - a proxy or crash page, not our JSON
        code, message, field, details = f"http_{status}", response.text[:500] or response.reason_phrase, None, {}
    if field:
        details = {**details, "field": field}
    request_id = response.headers.get("x-request-id")
    kwargs = dict(code=code, status_code=status, operation=operation, details=details, request_id=request_id)
    if status == 401:
        return AuthError(message, hint="pass api_key= or set PYTRIO_API_KEY to a key the worker accepts", **kwargs)
    if status in (400, 422):
        return ValidationError(message, source="worker", **kwargs)
    return APIError(message, **kwargs)
