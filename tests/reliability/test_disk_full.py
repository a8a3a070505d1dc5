"""A full disk under ``--storage`` is ``507 storage_full`` on every write the journal makes, on every protocol
(native run and op, PyTRIO service session, Tinker session), never a 500, a 4xx or a traceback; health stays up, and
everything works again once there is room. The journal's writes fail as SQLite's do on a full disk (the
``sqlite3.OperationalError`` it raises then); its reads and the checkpoint files are left alone."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import sys
from pathlib import Path

import pytest

from server_mock.engine.jobs import Job, job_result
from server_mock.errors import WorkerError

from .reliability_helpers import KEY_A, KEY_B
from .tenant_worker import client, native_run, worker

sys.path.insert(0, str(Path(__file__).parents[1] / "pytrio"))  # the raw PyTRIO client of tests/pytrio
import pytrio_raw  # noqa: E402

OPTIM = {"op": "optim_step", "adam_params": {"learning_rate": 1e-3}}


class FullDisk:
    """The journal's connection on a disk with no room left: every write statement fails as SQLite fails it then
    (``database or disk is full``); reads go through."""

    WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")

    def __init__(self, connection) -> None:
        self.connection = connection

    def execute(self, sql: str, *args):
        if sql.lstrip().upper().startswith(self.WRITES):
            raise sqlite3.OperationalError("database or disk is full")
        return self.connection.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.connection, name)


def fill(app) -> None:
    db = app.state.service.journal.db
    with db._lock:
        db._db = FullDisk(db._db)


def free(app) -> None:
    db = app.state.service.journal.db
    with db._lock:
        db._db = db._db.connection


def full(response, where: str) -> None:
    assert response.status_code == 507, f"{where}: {response.status_code} {response.text}"
    assert "storage_full" in response.text and "full" in response.text, f"{where}: {response.text}"


def test_a_full_journal_is_507_on_every_protocol_and_clears_when_freed(tiny_model_dir, tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    with worker(tiny_model_dir, tmp_path / "storage") as (base, app), client(base, KEY_A) as a, \
            client(base, KEY_B) as b:
        run = native_run(a)
        raw = pytrio_raw.RawClient(base, KEY_A)
        tinker = client(base, "tml-" + KEY_B)
        fill(app)

        full(b.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}), "native create run")
        full(a.post(f"/v1/training_runs/{run}/ops", json={"seq_id": 1, "payload": OPTIM}), "native op")
        full(raw.control("POST", "/service-sessions", json={"sdk_version": "raw"}), "pytrio session")
        full(tinker.post("/api/v1/create_session", json={"tags": [], "type": "create_session"}), "tinker session")
        assert a.get("/v1/health").status_code == 200
        assert "Traceback" not in caplog.text and "unhandled error" not in caplog.text

        free(app)
        assert b.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).status_code == 200
        op = a.post(f"/v1/training_runs/{run}/ops", json={"seq_id": 1, "payload": OPTIM})
        assert op.status_code == 200, op.text  # the refused op changed nothing: seq_id 1 is still free
        assert raw.session().startswith("ss_")
        made = tinker.post("/api/v1/create_session", json={"tags": [], "type": "create_session"})
        assert made.status_code == 200, made.text
        raw.close()
        tinker.close()


@pytest.mark.parametrize("code", ["storage_full", "storage_failed", "storage_budget_exceeded"])
def test_job_result_answers_507_before_the_server_error_codes(code):
    job = Job("req-1", "optim_step", dict)
    job.status, job.error = "failed", WorkerError(507, code, "optim_step: the disk under --storage is full")
    with pytest.raises(WorkerError) as err:
        asyncio.run(job_result(job))
    assert err.value.status == 507 and err.value.code == code


def test_job_result_keeps_500_for_the_workers_other_failures():
    job = Job("req-1", "optim_step", dict)
    job.status, job.error = "failed", WorkerError(500, "internal_error", "boom")
    with pytest.raises(WorkerError) as err:
        asyncio.run(job_result(job))
    assert err.value.status == 500
