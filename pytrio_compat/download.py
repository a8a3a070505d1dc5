"""Fetching a checkpoint archive from its signed URL: resumable, re-signed when the URL runs out.

The URL carries its own authority, so the request sends no API key (as PyTRIO's downloader does). With
``resume`` and a partial file at the destination, the request asks for the rest (``Range: bytes=<size>-``):
a 206 must cover exactly the rest of the file, and a 416 whose ``Content-Range`` is ``bytes */<size>``
means the local copy is already complete. A URL that expires within 60 s, or a 401/403, gets a new URL
from ``refresh``; 408/429/5xx and network errors are retried (``retry_max_attempts`` attempts in all).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx

from .config import Configuration
from .errors import RETRYABLE_STATUSES, APIError, ConnectionFailedError

REFRESH_WITHIN = timedelta(seconds=60)
CHUNK = 1 << 20
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_UNSATISFIED = re.compile(r"bytes \*/(\d+)")
_NETWORK_ERRORS = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError,
                   httpx.TimeoutException)


@dataclass
class Source:
    url: str
    expires: datetime


@dataclass
class Downloaded:
    bytes_written: int
    file_size_bytes: int
    status_code: int
    resumed: bool


async def download(source: Source, refresh: Callable[[], Awaitable[Source]], destination: Path, *, resume: bool,
                   config: Configuration, transport: httpx.AsyncBaseTransport | None = None) -> Downloaded:
    destination.parent.mkdir(parents=True, exist_ok=True)
    attempts = max(1, config.retry_max_attempts)
    delay = config.retry_initial_delay_seconds
    async with httpx.AsyncClient(timeout=config.request_timeout_seconds, follow_redirects=True,
                                 transport=transport) as http:
        for attempt in range(1, attempts + 1):
            last = attempt == attempts
            expires = source.expires if source.expires.tzinfo else source.expires.replace(tzinfo=timezone.utc)
            if expires - datetime.now(timezone.utc) <= REFRESH_WITHIN:
                source = await refresh()
            have = destination.stat().st_size if resume and destination.exists() else 0
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                async with http.stream("GET", source.url, headers=headers) as response:
                    status = response.status_code
                    if status in (401, 403) and not last:
                        source = await refresh()
                        continue
                    if status in RETRYABLE_STATUSES and not last:
                        await asyncio.sleep(delay)
                        delay = min(delay * config.retry_multiplier, config.retry_max_delay_seconds)
                        continue
                    if status == 416 and have:
                        done = _UNSATISFIED.fullmatch(response.headers.get("content-range", ""))
                        if done and int(done[1]) == have:
                            return Downloaded(0, have, status, resumed=True)
                    if status >= 400:
                        raise _error(status, await response.aread())
                    return await _write(response, destination, have)
            except _NETWORK_ERRORS as exc:
                if last:
                    raise ConnectionFailedError(f"checkpoint download failed: {type(exc).__name__}: {exc}",
                                                code="download.request_failed", retryable=True) from exc
                await asyncio.sleep(delay)
                delay = min(delay * config.retry_multiplier, config.retry_max_delay_seconds)
    raise APIError("checkpoint download failed after retries", code="download.failed", retryable=True)


async def _write(response: httpx.Response, destination: Path, have: int) -> Downloaded:
    append = response.status_code == 206
    expected = None
    if append:
        match = _RANGE.fullmatch(response.headers.get("content-range", ""))
        if not have or not match or int(match[1]) != have or int(match[2]) + 1 != int(match[3]):
            raise APIError("the download resumed with a Content-Range that does not cover the rest of the file",
                           code="download.invalid_content_range", status_code=206)
        expected = int(match[2]) - int(match[1]) + 1
    written = 0
    with open(destination, "ab" if append else "wb") as file:
        async for chunk in response.aiter_bytes(CHUNK):
            await asyncio.to_thread(file.write, chunk)
            written += len(chunk)
    if expected is not None and written != expected:
        raise APIError("the download ended before its Content-Range did", code="download.content_range_length_mismatch",
                       status_code=206)
    return Downloaded(written, destination.stat().st_size, response.status_code, resumed=append)


def _error(status: int, body: bytes) -> APIError:
    code = message = ""
    try:
        parsed = json.loads(body)
        fields = parsed.get("error", parsed) if isinstance(parsed, dict) else {}
        code, message = str(fields.get("code", "")), str(fields.get("message", ""))
    except (ValueError, AttributeError):
        message = body[:500].decode(errors="replace")
    return APIError(message or f"checkpoint download failed with HTTP {status}", code=code or "download.failed",
                    status_code=status)
