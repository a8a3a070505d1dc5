"""Errors the worker answers with: an HTTP status, a stable code, and a message naming the field."""

from __future__ import annotations


class WorkerError(Exception):
    retry_after = 1  # seconds a 429's client should wait before it retries (its Retry-After header)

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


def raising(exc: BaseException):
    """A thunk that raises ``exc`` when called: an error carried to where the work would have run."""

    def fail(*_args, **_kwargs):
        raise exc

    return fail


def bad_request(field: str, message: str, code: str = "invalid_request") -> WorkerError:
    return WorkerError(400, code, f"{field}: {message}", field)


def not_found(what: str, ident: str) -> WorkerError:
    return WorkerError(404, f"{what}_not_found", f"unknown {what.replace('_', ' ')}: {ident}")


def storage_error(what: str, exc: BaseException) -> WorkerError:
    """A write to ``--storage`` that failed (a full disk, a read-only file system): 507, nothing half written kept.
    A ``WorkerError`` (a budget refused before writing) passes as it is."""
    if isinstance(exc, WorkerError):
        return exc
    if is_disk_full(exc):
        return WorkerError(507, "storage_full", f"{what}: the disk under --storage is full ({exc}); nothing was "
                                                "changed: free space and retry")
    return WorkerError(507, "storage_failed", f"{what}: writing to --storage failed: {type(exc).__name__}: {exc}; "
                                              "nothing was changed")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the quota) under --storage is full: ENOSPC/EDQUOT from a file write, or
    SQLite's 'database or disk is full' (SQLITE_FULL) from the journal."""
    import errno
    import sqlite3

    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)
    return False
