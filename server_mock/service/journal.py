"""The worker's journal under ``--storage`` (``--durability full``): what it acknowledged, written before the
acknowledgement, so that a worker killed at any moment restarts into the same state (service/recovery.py).

- A training run: its configuration when created, with a state file (adapter weights, AdamW moments and step
  counts) as created; a new state file after each ``optim_step`` and ``load_state`` (the two ops that change the
  weights), the older one kept until the next, so a torn newest file falls back to the one before.
- Each accepted op: its seq_id, request id, body hash and payload (the checked datums of a forward op, the body of
  the others), in the database before the client gets its request id. The gradients pending since the last state
  are not written: they are recomputed at recovery by running the forward_backward ops after it again, which
  gives the same bits (the same weights, datums and order). A payload older than the previous state is dropped;
  its seq_id, request id and body hash stay (for the last 4096 ops), so a resend is still recognised.
- Each request's status and result once it finishes, until ``--result-ttl``; a sample request also its body and
  sampler when accepted, so one in flight runs again after a restart under the same request id.
- Samplers (their weights source), and in-memory sampler snapshots (their weights, one file each).

Results are written on the model's thread, before the request is marked finished, so nothing a client has seen
finish can be lost; a failed write (a full disk) fails that request with 507 instead.
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server_mock.engine.jobs import Job
from server_mock.errors import WorkerError, storage_error
from server_mock.storage import records
from server_mock.storage.files import read_verified, remove_leftovers, write_atomic
from server_mock.storage.state_db import StateDB

logger = logging.getLogger("server_mock")

# What a row that cannot be read back raises (cut JSON, a value that no longer validates, a field missing or of
# another type): such a row is quarantined at start. Any other failure (a model that does not load, memory) leaves
# the row where it is, for the next start.
DAMAGED_ROW = (ValueError, KeyError, TypeError, IndexError)
SEQS_REMEMBERED = 4096  # seq_ids per run whose request id and body hash are kept (as in memory)
STATE_OPS = ("optim_step", "load_state")  # the ops after which a run's state is written


def to_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: t.detach().to("cpu").numpy() for name, t in tensors.items()}


def to_torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.array(a)) for name, a in arrays.items()}


@dataclass
class RunRow:
    run_id: str
    tenant: str
    base_model: str
    spec: str
    meta: dict
    states: list[tuple[int, str, str]]  # (seq, file, sha), newest first


@dataclass
class OpRow:
    seq: int
    request_id: str
    kind: str
    body_hash: str
    payload: bytes | None
    done: bool
    front: dict | None = None  # what the front end that accepted it recorded with it (its own ids, its answer)


class FrontRecords:
    """A front end's own records in the journal's database (small JSON values in its namespaces), written before
    it answers; with no journal (``--durability checkpoint-only``) every write does nothing."""

    def __init__(self, journal: Journal | None) -> None:
        self.db = journal.db if journal is not None else None

    @property
    def on(self) -> bool:
        return self.db is not None

    def put(self, namespace: str, key: str, tenant: str, value: Any) -> None:
        """Record ``value``; a write the disk refuses raises 507 (``storage_full`` when it is full)."""
        if self.db is not None:
            try:
                self.db.put_record(namespace, key, tenant, value)
            except Exception as exc:  # noqa: BLE001 - e.g. sqlite3 'database or disk is full'
                raise storage_error(f"recording {namespace}", exc) from exc

    def delete(self, namespace: str, key: str) -> None:
        if self.db is not None:
            try:
                self.db.delete_record(namespace, key)
            except Exception as exc:  # noqa: BLE001
                raise storage_error(f"forgetting {namespace}", exc) from exc

    def delete_prefix(self, namespace: str, prefix: str) -> None:
        if self.db is not None:
            try:
                self.db.delete_records(namespace, prefix)
            except Exception as exc:  # noqa: BLE001
                raise storage_error(f"forgetting {namespace}", exc) from exc


class Journal:
    def __init__(self, storage: str | Path, result_ttl: float) -> None:
        self.dir = Path(storage) / "durable"
        self.files = self.dir / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        try:
            self.db = StateDB(self.dir / "state.db")
        except sqlite3.DatabaseError as exc:  # its head is garbage, or it was cut: not one row can be read
            raise RuntimeError(
                f"{self.dir / 'state.db'} is not a readable SQLite database ({exc}): the journal is damaged as a "
                "whole. Stop here and keep it: move state.db, state.db-wal and state.db-shm aside together (an "
                "SQLite '.recover' may get rows back), then start again with an empty journal; checkpoints under "
                "--storage are not touched") from None
        self.result_ttl = result_ttl

    def close(self) -> None:
        self.db.close()

    # --- runs ----------------------------------------------------------------------------------------------

    def run_created(self, run_id: str, tenant: str, base_model: str, spec_json: str, host, adapter) -> None:
        """On the model's thread, once the adapter exists: the run's row and its first state."""
        name, sha = self._write_state(run_id, 0, host, adapter)
        with self.db.transaction() as db:
            db.execute("INSERT OR REPLACE INTO runs (run_id, tenant, base_model, spec, created, state_seq, "
                       "state_file, state_sha) VALUES (?, ?, ?, ?, ?, 0, ?, ?)",
                       (run_id, tenant, base_model, spec_json, time.time(), name, sha))

    def run_labels(self, run_id: str, user_metadata: dict | None) -> None:
        self.db.execute("UPDATE runs SET meta = ? WHERE run_id = ?",
                        (json.dumps({"user_metadata": user_metadata}), run_id))

    def run_deleted(self, run_id: str) -> None:
        rows = self.db.query("SELECT state_file, prev_file FROM runs WHERE run_id = ?", (run_id,))
        with self.db.transaction() as db:
            db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            db.execute("DELETE FROM ops WHERE run_id = ?", (run_id,))
        for name in (rows[0] if rows else ()):
            if name:
                (self.files / name).unlink(missing_ok=True)

    def _write_state(self, run_id: str, seq: int, host, adapter) -> tuple[str, str]:
        state = {"seq": seq, "weights": to_numpy(host.adapter_weights(adapter)),
                 "optimizer": to_numpy(host.optimizer_state(adapter)), "version": adapter.version}
        name = f"runs/{run_id}/state-{seq}-{secrets.token_hex(4)}.bin"
        return name, write_atomic(self.files / name, records.pack(state))

    def read_state(self, row: RunRow) -> tuple[int, dict] | None:
        """The newest state of the run whose file is whole (a torn one is skipped, with a warning)."""
        for seq, name, sha in row.states:
            data = read_verified(self.files / name, sha)
            if data is not None:
                return seq, records.unpack(data)
            logger.warning("run %s: its state file %s (seq_id %d) is missing or torn; using the one before",
                           row.run_id, name, seq)
        return None

    def op_accepted(self, run_id: str, seq: int, request_id: str, kind: str, body_hash: str,
                    record: dict | None, front: dict | None = None, room: int | None = None) -> None:
        """Before the client gets ``request_id``: the op, with what it takes to run it again (and ``front``: what
        its front end needs to answer it again, in the same transaction). ``room``: the bytes its tenant's storage
        budget has left; a payload larger is refused (507) and nothing is written."""
        payload = records.pack(record) if record is not None else None
        if room is not None and len(payload or b"") > room:
            raise WorkerError(507, "storage_budget_exceeded",
                              f"{kind}: its journal record needs {len(payload or b'')} bytes and this API key's "
                              f"storage budget has {max(room, 0)} left (--max-storage-bytes-per-tenant counts "
                              "checkpoints and the journal: ops not yet folded into a saved state, results, "
                              "records): call optim_step, delete checkpoints, or raise the limit")
        self.db.execute("INSERT OR REPLACE INTO ops (run_id, seq, request_id, kind, body_hash, payload, front) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?)", (run_id, seq, request_id, kind, body_hash, payload,
                                                         json.dumps(front) if front is not None else None))

    def op_finished(self, run_id: str, seq: int, job: Job, result: dict | None, error, host=None,
                    adapter=None) -> None:
        """On the model's thread, before the op is marked finished: its result, and (``adapter``: an optim_step or
        load_state that succeeded) the run's new state, in one transaction."""
        state = self._write_state(run_id, seq, host, adapter) if adapter is not None else None
        if state is not None:
            from server_mock.storage import crash_points
            crash_points.reached("state_write")
        old: list[str] = []
        with self.db.transaction() as db:
            self._put_request(db, job, result, error)
            db.execute("UPDATE ops SET done = 1 WHERE run_id = ? AND seq = ?", (run_id, seq))
            if state is not None:
                row = db.execute("SELECT state_seq, state_file, prev_file FROM runs WHERE run_id = ?",
                                 (run_id,)).fetchone()
                if row is None:  # deleted meanwhile
                    old.append(state[0])
                else:
                    prev_seq, prev_file, dropped = row
                    db.execute("UPDATE runs SET prev_seq = state_seq, prev_file = state_file, prev_sha = state_sha, "
                               "state_seq = ?, state_file = ?, state_sha = ? WHERE run_id = ?",
                               (seq, state[0], state[1], run_id))
                    if dropped:
                        old.append(dropped)
                    # payloads up to the state before the new one are never run again
                    db.execute("UPDATE ops SET payload = NULL WHERE run_id = ? AND seq <= ?", (run_id, prev_seq))
                    db.execute("DELETE FROM ops WHERE run_id = ? AND seq <= ?", (run_id, seq - SEQS_REMEMBERED))
        for name in old:
            (self.files / name).unlink(missing_ok=True)

    def runs(self) -> list[RunRow]:
        out = []
        for (run_id, tenant, base_model, spec, meta, seq, name, sha, prev_seq, prev_name, prev_sha) in self.db.query(
                "SELECT run_id, tenant, base_model, spec, meta, state_seq, state_file, state_sha, prev_seq, "
                "prev_file, prev_sha FROM runs ORDER BY created"):
            states = [(seq, name, sha)] + ([(prev_seq, prev_name, prev_sha)] if prev_name else [])
            try:
                out.append(RunRow(run_id, tenant, base_model, spec, json.loads(meta), states))
            except ValueError as exc:
                self.quarantine("runs", (run_id,), tenant, f"its meta is not JSON: {exc}")
        return out

    def ops(self, run_id: str) -> list[OpRow]:
        out = []
        for seq, rid, kind, body_hash, payload, done, front in self.db.query(
                "SELECT seq, request_id, kind, body_hash, payload, done, front FROM ops WHERE run_id = ? ORDER BY seq",
                (run_id,)):
            try:
                out.append(OpRow(seq, rid, kind, body_hash, payload, bool(done), json.loads(front) if front else None))
            except ValueError as exc:
                self.quarantine("ops", (run_id, seq), None, f"its front is not JSON: {exc}")
        return out

    def quarantine(self, table: str, key: tuple, tenant: str | None, reason: str) -> None:
        """A row that cannot be taken up at start: moved aside whole (``StateDB.quarantine``), logged with its key."""
        logger.error("state.db: %s row %s (tenant %s) cannot be restored: %s; moved to the quarantine table, the "
                     "rest is restored", table, ":".join(map(str, key)), tenant, reason)
        self.db.quarantine(table, key, reason)

    # --- requests --------------------------------------------------------------------------------------------

    def _put_request(self, db, job: Job, result: dict | None, error) -> None:
        err = None if error is None else json.dumps({"status": error.status, "code": error.code,
                                                     "message": error.message, "field": error.field})
        db.execute("INSERT INTO requests (request_id, tenant, kind, status, result, error, created, finished) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO UPDATE SET status = excluded.status, "
                   "result = excluded.result, error = excluded.error, finished = excluded.finished, payload = NULL",
                   (job.request_id, job.owner, job.kind, "failed" if error is not None else "succeeded",
                    records.pack(result) if result is not None else None, err, time.time(), time.time()))

    def request_finished(self, job: Job, result: dict | None, error) -> None:
        with self.db.transaction() as db:
            self._put_request(db, job, result, error)

    def sample_accepted(self, request_id: str, tenant: str, sampler_id: str, body: str,
                        front: dict | None = None) -> None:
        self.db.execute("INSERT OR REPLACE INTO requests (request_id, tenant, kind, status, created, sampler_id, "
                        "payload, front) VALUES (?, ?, 'sample', 'queued', ?, ?, ?, ?)",
                        (request_id, tenant, time.time(), sampler_id, body.encode(),
                         json.dumps(front) if front is not None else None))

    def front_requests(self) -> list[tuple[str, str, str | None, dict]]:
        """(request id, tenant, sampler id, front) of each request a front end recorded its own fields with, unfinished
        or finished within its TTL, oldest first."""
        return [(rid, tenant, sampler_id, json.loads(front)) for rid, tenant, sampler_id, front in self.db.query(
            "SELECT request_id, tenant, sampler_id, front FROM requests WHERE front IS NOT NULL AND "
            "(finished IS NULL OR finished >= ?) ORDER BY created", (time.time() - self.result_ttl,))]

    def finished_requests(self) -> list[tuple[str, str, str, str, Any, dict | None, float]]:
        """(request id, tenant, kind, status, result, error, finished) of each finished request within its TTL."""
        out = []
        for rid, tenant, kind, status, result, error, finished in self.db.query(
                "SELECT request_id, tenant, kind, status, result, error, finished FROM requests "
                "WHERE finished IS NOT NULL AND finished >= ? ORDER BY finished", (time.time() - self.result_ttl,)):
            try:
                out.append((rid, tenant, kind, status, records.unpack(result) if result is not None else None,
                            json.loads(error) if error else None, finished))
            except Exception as exc:  # noqa: BLE001 - a damaged row: set aside, the others are restored
                self.quarantine("requests", (rid,), tenant, f"its result or error cannot be read: {exc}")
        return out

    def unfinished_samples(self) -> list[tuple[str, str, str, str]]:
        """(request id, tenant, sampler id, body) of each sample request accepted and not finished."""
        return [(rid, tenant, sampler_id, payload.decode()) for rid, tenant, sampler_id, payload in self.db.query(
            "SELECT request_id, tenant, sampler_id, payload FROM requests WHERE finished IS NULL AND payload IS NOT "
            "NULL ORDER BY created")]

    def sweep(self) -> int:
        """Forget the requests finished more than ``result_ttl`` ago."""
        return self.db.execute("DELETE FROM requests WHERE finished IS NOT NULL AND finished < ?",
                               (time.time() - self.result_ttl,))

    # --- samplers and snapshots ------------------------------------------------------------------------------

    def sampler_created(self, sampler_id: str, tenant: str, base_model: str, model_path: str | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO samplers VALUES (?, ?, ?, ?, ?)",
                        (sampler_id, tenant, base_model, model_path, time.time()))

    def sampler_dropped(self, sampler_id: str) -> None:
        self.db.execute("DELETE FROM samplers WHERE sampler_id = ?", (sampler_id,))

    def samplers(self) -> list[tuple[str, str, str, str | None]]:
        return self.db.query("SELECT sampler_id, tenant, base_model, model_path FROM samplers ORDER BY created")

    def snapshot_saved(self, path: str, tenant: str, base_model: str, snapshot) -> None:
        """On the model's thread: an in-memory sampler snapshot's weights, so its path outlives the process."""
        data = {"snapshot_id": snapshot.snapshot_id, "spec": snapshot.spec.model_dump_json(),
                "targets": list(snapshot.target_modules), "tensors": to_numpy(snapshot.tensors)}
        name = f"snapshots/{secrets.token_hex(8)}.bin"
        sha = write_atomic(self.files / name, records.pack(data))
        old = self.db.query("SELECT file FROM snapshots WHERE path = ?", (path,))
        self.db.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?, ?, ?, ?)",
                        (path, tenant, base_model, name, sha, time.time()))
        for (file,) in old:
            (self.files / file).unlink(missing_ok=True)

    def snapshot_dropped(self, path: str) -> None:
        old = self.db.query("SELECT file FROM snapshots WHERE path = ?", (path,))
        self.db.execute("DELETE FROM snapshots WHERE path = ?", (path,))
        for (file,) in old:
            (self.files / file).unlink(missing_ok=True)

    def snapshots(self) -> list[tuple[str, str, str, dict | None]]:
        """(path, tenant, base model, contents or None when the file is torn) of each snapshot, oldest first."""
        out = []
        for path, tenant, base_model, name, sha in self.db.query(
                "SELECT path, tenant, base_model, file, sha FROM snapshots ORDER BY created"):
            data = read_verified(self.files / name, sha)
            out.append((path, tenant, base_model, records.unpack(data) if data is not None else None))
        return out

    # --- hygiene ---------------------------------------------------------------------------------------------

    def collect_orphans(self) -> int:
        """At start: delete temporary files a crash left, and files no row names (written just before a crash,
        or whose row was deleted just before one); how many."""
        removed = remove_leftovers(self.files)
        named = {name for row in self.db.query("SELECT state_file, prev_file FROM runs") for name in row if name}
        named |= {name for (name,) in self.db.query("SELECT file FROM snapshots")}
        for _source, _key, _tenant, _reason, row in self.db.quarantined("runs"):  # kept for whoever repairs them
            named |= {row.get("state_file"), row.get("prev_file")}
        for path in self.files.rglob("*.bin"):
            if path.relative_to(self.files).as_posix() not in named:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def tenant_bytes(self, tenant: str) -> int:
        """What the journal holds for ``tenant``: op payloads, request results and bodies, protocol records, and
        its runs' state files and snapshots' files (counted in --max-storage-bytes-per-tenant)."""
        (ops,) = self.db.query("SELECT COALESCE(SUM(LENGTH(o.payload)), 0) FROM ops o JOIN runs r ON "
                               "o.run_id = r.run_id WHERE r.tenant = ?", (tenant,))[0]
        (requests,) = self.db.query("SELECT COALESCE(SUM(COALESCE(LENGTH(result), 0) + COALESCE(LENGTH(payload), 0)), "
                                    "0) FROM requests WHERE tenant = ?", (tenant,))[0]
        (recorded,) = self.db.query("SELECT COALESCE(SUM(LENGTH(value)), 0) FROM records WHERE tenant = ?",
                                    (tenant,))[0]
        names = [name for row in self.db.query("SELECT state_file, prev_file FROM runs WHERE tenant = ?", (tenant,))
                 for name in row if name]
        names += [name for (name,) in self.db.query("SELECT file FROM snapshots WHERE tenant = ?", (tenant,))]
        files = 0
        for name in names:
            try:
                files += (self.files / name).stat().st_size
            except OSError:
                pass
        return ops + requests + recorded + files

    def bytes_used(self) -> int:
        return sum(p.stat().st_size for p in self.dir.rglob("*") if p.is_file())
