"""Files written so that a crash leaves either the old file or the new one, and a torn write is recognised.

``write_atomic`` writes to a temporary name in the same folder, fsyncs it, renames it over the target and fsyncs
the folder; it returns the content's SHA-256, which the caller records (``state_db``) and ``read_verified`` checks:
a file whose bytes do not hash to what was recorded (a torn or truncated write, a disk error) reads as missing, and
the caller falls back to the previous good state. Temporary files left by a crash are removed by
``remove_leftovers`` at start.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

TMP_MARK = ".tmp-"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically and durably; return its SHA-256 (hex)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return hashlib.sha256(data).hexdigest()


def read_verified(path: Path, sha256: str | None) -> bytes | None:
    """The file's bytes if they hash to ``sha256`` (any bytes when it is None); None if missing or torn."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        return None
    return data


def remove_leftovers(folder: Path) -> int:
    """Delete the temporary files a crash left under ``folder`` (recursively); how many."""
    if not folder.exists():
        return 0
    removed = 0
    for path in folder.rglob(f".*{TMP_MARK}*"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed += 1
    return removed
