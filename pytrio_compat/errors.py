"""One small exception tree. Every error says what went wrong and, where we know it, how to fix it."""

from __future__ import annotations

from typing import Any

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class PyTrioError(Exception):
    """Root of every error the SDK raises on purpose."""

    default_code = "pytrio.error"
    default_source = "sdk"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        hint: str | None = None,
        details: dict[str, Any] | None = None,
        status_code: int = 0,
        retryable: bool | None = None,
        operation: str | None = None,
        request_id: str | None = None,
        source: str | None = None,
    ) -> None:
        self.message = message
        self.code = code or self.default_code
        self.hint = hint
        self.details = dict(details or {})
        self.status_code = status_code
        self.retryable = retryable if retryable is not None else status_code in RETRYABLE_STATUSES
        self.operation = operation
        self.request_id = request_id
        self.source = source or self.default_source
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [self.message]
        if self.hint:
            parts.append(f"Hint: {self.hint}")
        if self.operation:
            parts.append(f"Request: {self.operation}")
        if self.request_id:
            parts.append(f"Context: request_id={self.request_id}")
        if self.details:
            parts.append(f"Details: {self.details}")
        return " | ".join(parts)

    def diagnostic_fields(self) -> dict[str, Any]:
        return {
            "code": self.code, "source": self.source, "status_code": self.status_code,
            "retryable": self.retryable, "operation": self.operation, "request_id": self.request_id,
        }


class ValidationError(PyTrioError):
    default_code = "validation.failed"


class DependencyError(PyTrioError):
    default_code = "dependency.missing"


class ConfigurationError(PyTrioError):
    default_code = "configuration.error"


class AuthError(PyTrioError):
    default_code = "auth.failed"
    default_source = "auth"


class APIError(PyTrioError):
    """The worker answered with an error status (4xx/5xx) or could not be reached."""

    default_code = "api.request_failed"
    default_source = "worker"


class ConnectionFailedError(APIError):
    default_code = "api.connection_failed"


class EventFailedError(PyTrioError):
    """A queued request ran on the worker and failed there."""

    default_code = "event.failed"
    default_source = "event"

    def __init__(self, message: str, *, request_id: str | None = None, code: str | None = None, **kw: Any):
        super().__init__(message, code=code, request_id=request_id, **kw)
        self.event_message = message


class RequestLostError(PyTrioError):
    """The worker no longer knows a request we were waiting for (it restarted, or the result expired)."""

    default_code = "event.lost"
    default_source = "worker"


class TrainingRunBrokenError(PyTrioError):
    default_code = "training.run_broken"
