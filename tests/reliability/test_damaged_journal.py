"""A damaged journal never keeps the worker from starting: a row of ``durable/state.db`` that cannot be read back (a
PyTRIO record whose JSON is cut, a native run whose spec no longer validates) is moved to the quarantine table with
its key and why, every other run is restored and served, and the damaged run's owner is told what happened (410)
instead of 'unknown'. A journal found empty beside run state files and checkpoints (its database replaced, its
``state.db-wal`` deleted) is said loudly, and the state files are kept."""

from __future__ import annotations

import logging
import sqlite3
import sys
from pathlib import Path

import pytest

from .reliability_helpers import KEY_A, KEY_B
from .tenant_worker import client, native_run, worker

sys.path.insert(0, str(Path(__file__).parents[1] / "pytrio"))  # the raw PyTRIO client of tests/pytrio
import pytrio_raw  # noqa: E402


def test_a_damaged_row_is_quarantined_and_the_rest_is_served(tiny_model_dir, tmp_path, caplog):
    storage = tmp_path / "storage"
    with worker(tiny_model_dir, storage) as (base, _app), client(base, KEY_A) as a, client(base, KEY_B) as b:
        damaged_native, kept_native, b_native = native_run(a), native_run(a), native_run(b)
        raw = pytrio_raw.RawClient(base, KEY_A)
        session = raw.session()
        damaged_pytrio, kept_pytrio = raw.training_run(session), raw.training_run(session)
        for run in (damaged_pytrio, kept_pytrio):
            assert run.init(str(tiny_model_dir.resolve()), rank=4)["status"] == "succeeded"
        raw.close()
    with sqlite3.connect(storage / "durable" / "state.db") as db:
        db.execute("UPDATE runs SET spec = ? WHERE run_id = ?", ('{"rank": "four"}', damaged_native))
        db.execute("UPDATE records SET value = ? WHERE namespace = 'pytrio.training_run' AND key = ?",
                   ('{"session": ', damaged_pytrio.cuid))

    caplog.set_level(logging.ERROR, logger="server_mock")
    with worker(tiny_model_dir, storage) as (base, app), client(base, KEY_A) as a, client(base, KEY_B) as b:
        assert app.state.recovered["quarantined"] == 2
        assert a.get(f"/v1/training_runs/{kept_native}").status_code == 200
        assert b.get(f"/v1/training_runs/{b_native}").status_code == 200
        op = a.post(f"/v1/training_runs/{kept_native}/ops",
                    json={"seq_id": 1, "payload": {"op": "optim_step", "adam_params": {"learning_rate": 1e-3}}})
        assert op.status_code == 200, op.text

        gone = a.get(f"/v1/training_runs/{damaged_native}")
        assert gone.status_code == 410 and "training_run_damaged" in gone.text and "quarantine" in gone.text
        assert b.get(f"/v1/training_runs/{damaged_native}").status_code == 404  # the owner alone is told

        raw = pytrio_raw.RawClient(base, KEY_A)
        kept_pytrio.client = raw  # the same run and token, on the new worker's address
        kept = raw.control("GET", f"/training-runs/{kept_pytrio.cuid}")
        assert kept.status_code == 200, kept.text
        answer = kept_pytrio.run("trainer.optimize_step", {"adam_params": {
            "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}})  # its token still opens it
        assert answer["status"] == "succeeded", answer
        lost = raw.control("GET", f"/training-runs/{damaged_pytrio.cuid}")
        assert lost.status_code == 410 and "training_run_damaged" in lost.text, lost.text
        raw.close()

    with sqlite3.connect(storage / "durable" / "state.db") as db:
        rows = {source: (key, reason) for source, key, reason in
                db.execute("SELECT source, key, reason FROM quarantine").fetchall()}
    assert rows.keys() == {"records:pytrio.training_run", "runs"}
    key, reason = rows["records:pytrio.training_run"]
    assert key == damaged_pytrio.cuid and "JSON" in reason
    assert rows["runs"][0] == damaged_native and "ValidationError" in rows["runs"][1]
    logged = caplog.text
    assert damaged_native in logged and damaged_pytrio.cuid in logged and "quarantine" in logged


def test_an_empty_journal_beside_run_state_is_said_loudly_and_the_files_kept(tiny_model_dir, tmp_path, caplog):
    storage = tmp_path / "storage"
    with worker(tiny_model_dir, storage) as (base, _app), client(base, KEY_A) as a:
        run = native_run(a)
    files = sorted((storage / "durable" / "files" / "runs" / run).glob("*.bin"))
    assert files
    for name in ("state.db", "state.db-wal", "state.db-shm"):  # as if the WAL of a killed worker were deleted
        (storage / "durable" / name).unlink(missing_ok=True)

    caplog.set_level(logging.ERROR, logger="server_mock")
    with worker(tiny_model_dir, storage) as (base, _app), client(base, KEY_A) as a:
        assert a.get("/v1/health").status_code == 200
        assert a.get(f"/v1/training_runs/{run}").status_code == 404
    assert "THE JOURNAL IS EMPTY" in caplog.text and "state.db-wal" in caplog.text
    assert all(f.exists() for f in files)  # not collected as orphans


def test_a_fresh_storage_starts_quietly(tiny_model_dir, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="server_mock")
    with worker(tiny_model_dir, tmp_path / "storage") as (base, app):
        assert app.state.recovered["quarantined"] == 0
    assert "JOURNAL IS EMPTY" not in caplog.text


def test_a_database_damaged_as_a_whole_is_refused_with_what_to_do(tmp_path):
    from server_mock.service.journal import Journal

    durable = tmp_path / "durable"
    durable.mkdir()
    (durable / "state.db").write_bytes(b"this is no database" * 512)
    with pytest.raises(RuntimeError, match="not a readable SQLite database") as err:
        Journal(tmp_path, 60.0)
    assert "state.db-wal" in str(err.value) and "move" in str(err.value)
    assert (durable / "state.db").read_bytes().startswith(b"this is no database")  # left as it was


def test_a_failure_that_is_not_the_rows_leaves_the_row_for_the_next_start(tiny_model_dir, tmp_path, monkeypatch):
    from server_mock.service import restore

    storage = tmp_path / "storage"
    with worker(tiny_model_dir, storage) as (base, _app), client(base, KEY_A) as a:
        run = native_run(a)

    async def fails(*args):
        raise RuntimeError("the device ran out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(restore, "_rebuild", fails)
        with worker(tiny_model_dir, storage) as (base, app), client(base, KEY_A) as a:
            assert app.state.recovered["quarantined"] == 0
            assert a.get(f"/v1/training_runs/{run}").status_code == 404
    with worker(tiny_model_dir, storage) as (base, app), client(base, KEY_A) as a:
        assert a.get(f"/v1/training_runs/{run}").status_code == 200  # restored once the failure is gone
