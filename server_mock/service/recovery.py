"""Recovery at start (``--durability full``): a worker started on existing storage takes up what the journal
(service/journal.py) recorded, before it serves its first request.

In order: files a crash left half written or unnamed are deleted; finished requests within their TTL answer polls
again; in-memory sampler snapshots and samplers come back; each training run is rebuilt (service/restore.py) from
its newest whole state file, the forward_backward ops acknowledged after it run again (their gradients were
pending), and its ops not yet finished are queued again under their request ids, in seq_id order; sample requests
in flight are queued again under theirs. A client polling a request it was given before the crash gets its
answer; a client resending an op the crash kept it from seeing acknowledged gets the original request back (its
seq_id and body hash are recorded), so the op runs once. Last, each front end's hook (``service.recovery_hooks``)
rebuilds its own state (the Tinker protocol's sessions, models, seq_id gates and futures) from its records and the
ops above.
"""

from __future__ import annotations

import logging
import sqlite3
import time

from pytrio_compat.wire import LoraSpec, SampleRequest
from server_mock.engine.jobs import Job
from server_mock.errors import WorkerError
from server_mock.lora import Snapshot
from server_mock.service.journal import DAMAGED_ROW, to_torch
from server_mock.service.restore import restore_run

logger = logging.getLogger("server_mock")


async def recover(service) -> dict[str, int]:
    """Restore what ``service.journal`` holds; how many of each thing came back (and the seconds it took)."""
    journal = service.journal
    if journal is None:
        return {}
    try:
        return await _recover(service, journal)
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError):
            raise
        raise RuntimeError(f"{journal.db.path} is damaged as a whole ({exc}): stop here and keep it: move state.db, "
                           "state.db-wal and state.db-shm aside together (an SQLite '.recover' may get rows back), "
                           "then start again with an empty journal; checkpoints under --storage are not touched"
                           ) from None


async def _recover(service, journal) -> dict[str, int]:
    started = time.perf_counter()
    lost = _journal_lost(service)
    counts = {"orphans_removed": (0 if lost else journal.collect_orphans()) + service.store.remove_leftovers(),
              "requests": 0, "snapshots": 0, "samplers": 0, "runs": 0, "samples_requeued": 0, "quarantined": 0}
    now = time.time()
    for rid, tenant, kind, _status, result, error, finished in journal.finished_requests():
        err = None if error is None else WorkerError(error["status"], error["code"], error["message"], error["field"])
        service.requests.restore(rid, tenant, kind, result, err, now - finished)
        counts["requests"] += 1
    for path, tenant, base_model, data in journal.snapshots():
        if data is None:
            logger.warning("sampler snapshot %s: its file is missing or torn; it is gone", path)
            journal.snapshot_dropped(path)
            continue
        try:
            spec = LoraSpec.model_validate_json(data["spec"])
            snap = Snapshot(data["snapshot_id"], spec, tuple(data["targets"]), to_torch(data["tensors"]))
        except DAMAGED_ROW as exc:  # one damaged row never stops the worker starting
            journal.quarantine("snapshots", (path,), tenant, _why(exc))
            continue
        service.checkpoints.put_snapshot(path, tenant, base_model, snap)
        counts["snapshots"] += 1
    for sampler_id, tenant, base_model, model_path in journal.samplers():
        try:
            await service.samplers.restore(sampler_id, tenant, base_model, model_path)
            counts["samplers"] += 1
        except WorkerError as exc:
            logger.warning("sampler %s not restored: %s", sampler_id, exc.message)
            journal.sampler_dropped(sampler_id)
        except DAMAGED_ROW as exc:
            journal.quarantine("samplers", (sampler_id,), tenant, _why(exc))
        except Exception as exc:  # noqa: BLE001 - not the row's fault: kept for the next start
            logger.error("sampler %s not restored this time (kept in the journal): %s", sampler_id, _why(exc))
    for row in journal.runs():
        try:
            run = await restore_run(service, row, journal.ops(row.run_id))
        except WorkerError as exc:  # its model is no longer served, or over a limit
            logger.error("run %s not restored: %s", row.run_id, exc.message)
            run = None
        except DAMAGED_ROW as exc:  # e.g. a spec that no longer validates: set aside, the rest goes on
            journal.quarantine("runs", (row.run_id,), row.tenant, _why(exc))
            service.runs.set_damaged(row.run_id, row.tenant, _why(exc))
            run = None
        except Exception as exc:  # noqa: BLE001 - not the row's fault (a model that fails to load): kept
            logger.error("run %s not restored this time (kept in the journal for the next start): %s", row.run_id,
                         _why(exc))
            run = None
        counts["runs"] += run is not None
    for rid, tenant, sampler_id, body in journal.unfinished_samples():
        try:
            request = SampleRequest.model_validate_json(body)
        except DAMAGED_ROW as exc:
            journal.quarantine("requests", (rid,), tenant, _why(exc))
            continue
        try:
            service.samplers.submit(sampler_id, request, tenant, request_id=rid, requeued=True)
            counts["samples_requeued"] += 1
        except WorkerError as exc:  # its sampler or weights are gone: the poll gets the reason
            service.requests.restore(rid, tenant, "sample", None, exc, 0.0)
            journal.request_finished(Job(rid, "sample", dict, owner=tenant), None, exc)
    for hook in service.recovery_hooks:  # each front end takes up its own records, on top of the service's
        counts.update(await hook())
    counts["quarantined"] = len(journal.db.quarantined())
    counts["seconds"] = round(time.perf_counter() - started, 3)
    if any(value for name, value in counts.items() if name not in ("seconds", "orphans_removed")):
        logger.warning("recovered from %s: %s", journal.dir, counts)
    if counts["quarantined"]:
        logger.error("%d row(s) of %s could not be restored and sit in its quarantine table (see the errors above); "
                     "the worker serves the rest", counts["quarantined"], journal.db.path)
    return counts


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:300]}"


def _journal_lost(service) -> bool:
    """Whether the journal is empty while the storage holds run state files it would name: its database was
    replaced, or its ``state.db-wal`` file deleted after a crash. Said loudly; the state files are then kept (not
    collected as orphans) for whoever restores the database. Checkpoints beside an empty journal are only a warning:
    they outlive their runs, so that is also what a worker with no live run leaves."""
    journal = service.journal
    if not journal.db.is_empty():
        return False
    states = sum(1 for _ in journal.files.glob("runs/*/*.bin"))
    wal = journal.db.path.with_name(journal.db.path.name + "-wal")
    if states:
        logger.error("THE JOURNAL IS EMPTY but %s holds %d run state file(s): nothing of the runs, requests and "
                     "sessions before this start is restored. Was %s deleted or replaced, or %s deleted (it is part "
                     "of the state: never delete it)? The state files are kept; stop the worker and put the "
                     "database back to restore them", journal.files, states, journal.db.path, wal.name)
        return True
    if any((service.store.root / "checkpoints").glob("*/*/*")):
        logger.warning("the journal is empty beside checkpoints under %s: expected if no run, sampler or session was "
                       "live at the last stop; if %s or %s was deleted, the runs of the last process are lost "
                       "(their checkpoints are not)", service.store.root, journal.db.path.name, wal.name)
    return False
