"""Errors the worker answers with: an HTTP status, a stable code, and a message naming the field."""

from __future__ import annotations


class WorkerError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


def bad_request(field: str, message: str, code: str = "invalid_request") -> WorkerError:
    return WorkerError(400, code, f"{field}: {message}", field)


def not_found(what: str, ident: str) -> WorkerError:
    return WorkerError(404, f"{what}_not_found", f"unknown {what.replace('_', ' ')}: {ident}")
