"""The worker's durable state: one SQLite database under ``--storage`` (WAL journal), beside the checkpoint folders.

What lives here: training runs (configuration, tenant, the seq_id of their last two saved states), the ops accepted
for each run (kind, body hash, request id, and the payload of those after the older saved state), requests with
their status and result until their TTL (a sample request also with its body, to run it again), samplers,
in-memory sampler snapshots, and each protocol's own small records under a namespace (plus, on an op or a request,
the fields its front end needs to answer it again after a restart: ``front``). A run's adapter and Adam
state, and a snapshot's weights, are files written atomically beside it (``storage.files``), named here with their
SHA-256 so a torn write is detected at start.

One connection, shared by the event loop and the model threads behind a lock; every write is its own
transaction. ``synchronous`` is FULL by default (a commit is on disk before it returns).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger("server_mock")

SCHEMA_VERSION = 2  # 2: ops and requests carry a front end's own fields (``front``, JSON)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, base_model TEXT NOT NULL, spec TEXT NOT NULL,
    created REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}',
    state_seq INTEGER, state_file TEXT, state_sha TEXT,
    prev_seq INTEGER, prev_file TEXT, prev_sha TEXT);
CREATE TABLE IF NOT EXISTS ops (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, request_id TEXT NOT NULL, kind TEXT NOT NULL,
    body_hash TEXT NOT NULL, payload BLOB, done INTEGER NOT NULL DEFAULT 0, front TEXT,
    PRIMARY KEY (run_id, seq));
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
    result BLOB, error TEXT, created REAL NOT NULL, finished REAL, sampler_id TEXT, payload BLOB, front TEXT);
CREATE INDEX IF NOT EXISTS requests_finished ON requests (finished);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, base_model TEXT NOT NULL, model_path TEXT,
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    path TEXT PRIMARY KEY, tenant TEXT NOT NULL, base_model TEXT NOT NULL, file TEXT NOT NULL, sha TEXT NOT NULL,
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    namespace TEXT NOT NULL, key TEXT NOT NULL, tenant TEXT NOT NULL, value TEXT NOT NULL, expires REAL,
    PRIMARY KEY (namespace, key));
"""

# Rows that could not be read back at start (cut JSON, a value that no longer validates), moved here whole, with
# why, so that the rest of the state is taken up and an operator can look at (or repair and move back) each one.
# Created on every open (schema 2 and older databases get it too).
_QUARANTINE = """
CREATE TABLE IF NOT EXISTS quarantine (
    source TEXT NOT NULL, key TEXT NOT NULL, tenant TEXT, reason TEXT NOT NULL, row TEXT NOT NULL,
    moved REAL NOT NULL);
"""

_KEYS = {"runs": ("run_id",), "requests": ("request_id",), "samplers": ("sampler_id",), "snapshots": ("path",),
         "ops": ("run_id", "seq"), "records": ("namespace", "key")}


class StateDB:
    def __init__(self, path: str | Path, synchronous: str = "FULL") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("PRAGMA foreign_keys=ON")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} was written by a newer worker (schema {version} > {SCHEMA_VERSION})")
        if version == 0:
            self._db.executescript(_SCHEMA)  # (executescript commits on its own)
        elif version == 1:
            self._db.executescript("ALTER TABLE ops ADD COLUMN front TEXT; ALTER TABLE requests ADD COLUMN front TEXT;")
        if version < SCHEMA_VERSION:
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._db.executescript(_QUARANTINE)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def execute(self, sql: str, args: tuple = ()) -> int:
        """One statement as its own transaction; the rows it changed."""
        with self.transaction() as db:
            return db.execute(sql, args).rowcount

    def quarantine(self, table: str, key: tuple, reason: str) -> None:
        """Move one row of ``table`` (its primary key: ``key``) to the quarantine table, with ``reason``; in one
        transaction. Its blobs are kept as hex."""
        names = _KEYS[table]
        where = " AND ".join(f"{name} = ?" for name in names)
        with self.transaction() as db:
            cursor = db.execute(f"SELECT * FROM {table} WHERE {where}", key)
            found = cursor.fetchone()
            if found is None:
                return
            row = {col[0]: (value.hex() if isinstance(value, bytes) else value)
                   for col, value in zip(cursor.description, found)}
            shown = ":".join(str(part) for part in (key[1:] if table == "records" else key))
            source = f"records:{key[0]}" if table == "records" else table
            db.execute("INSERT INTO quarantine VALUES (?, ?, ?, ?, ?, ?)",
                       (source, shown, row.get("tenant"), reason, json.dumps(row), time.time()))
            db.execute(f"DELETE FROM {table} WHERE {where}", key)

    def quarantined(self, source: str | None = None) -> list[tuple[str, str, str | None, str, dict]]:
        """(source, key, tenant, reason, row) of each quarantined row (of ``source``: a table, or
        ``records:<namespace>``), oldest first."""
        sql = "SELECT source, key, tenant, reason, row FROM quarantine"
        rows = self.query(sql + (" WHERE source = ?" if source else "") + " ORDER BY moved",
                          (source,) if source else ())
        return [(src, key, tenant, reason, json.loads(row)) for src, key, tenant, reason, row in rows]

    def is_empty(self) -> bool:
        """Whether no table holds a row (a new database, or one whose WAL file was lost)."""
        return not any(self.query(f"SELECT 1 FROM {table} LIMIT 1") for table in _KEYS)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- protocol records: small JSON values by (namespace, key), owned by a tenant ---------------------------

    def put_record(self, namespace: str, key: str, tenant: str, value: Any, ttl: float | None = None) -> None:
        expires = time.time() + ttl if ttl is not None else None
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)",
                       (namespace, key, tenant, json.dumps(value), expires))

    def get_record(self, namespace: str, key: str) -> tuple[str, Any] | None:
        rows = self.query("SELECT tenant, value, expires FROM records WHERE namespace = ? AND key = ?",
                          (namespace, key))
        if not rows or (rows[0][2] is not None and rows[0][2] < time.time()):
            return None
        return rows[0][0], json.loads(rows[0][1])

    def records(self, namespace: str) -> list[tuple[str, str, Any]]:
        """The live records of ``namespace``; one whose value is not JSON (a damaged row) is quarantined, logged."""
        now = time.time()
        out = []
        for key, tenant, value, expires in self.query(
                "SELECT key, tenant, value, expires FROM records WHERE namespace = ?", (namespace,)):
            if expires is not None and expires < now:
                continue
            try:
                out.append((key, tenant, json.loads(value)))
            except (ValueError, RecursionError) as exc:
                logger.error("state.db: record %s %r of tenant %s is damaged (%s); moved to the quarantine table",
                             namespace, key, tenant, exc)
                self.quarantine("records", (namespace, key), f"its value is not JSON: {exc}")
        return out

    def delete_record(self, namespace: str, key: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM records WHERE namespace = ? AND key = ?", (namespace, key))

    def delete_records(self, namespace: str, prefix: str) -> int:
        """Delete the records of ``namespace`` whose key starts with ``prefix``; how many."""
        with self.transaction() as db:
            return db.execute("DELETE FROM records WHERE namespace = ? AND substr(key, 1, ?) = ?",
                              (namespace, len(prefix), prefix)).rowcount

    def sweep_records(self) -> int:
        with self.transaction() as db:
            return db.execute("DELETE FROM records WHERE expires IS NOT NULL AND expires < ?", (time.time(),)).rowcount
