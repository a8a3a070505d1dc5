"""What a run that never steps leaves in the journal is bounded: its forward ops since the last optim_step (kept to
run again after a restart) are capped per run (``--max-pending-forward-ops``: one past it is 409 until the run
steps, and the count survives a restart), and the journal's bytes (op payloads, results, records, state files)
count in the API key's ``--max-storage-bytes-per-tenant`` with its checkpoints."""

from __future__ import annotations

import pytest

from server_mock.config import Limits, StorageOptions
from server_mock.errors import WorkerError
from server_mock.service.journal import Journal
from server_mock.storage import records

from .reliability_helpers import KEY_A, KEY_B, datum_wire
from .tenant_worker import client, native_run, worker

OPTIM = {"op": "optim_step", "adam_params": {"learning_rate": 1e-3}}


def fb(offset: int = 0, n: int = 20) -> dict:
    return {"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum_wire(offset, n)]}


def op(http, run: str, seq: int, payload: dict):
    return http.post(f"/v1/training_runs/{run}/ops", json={"seq_id": seq, "payload": payload})


def test_forward_ops_past_the_cap_wait_for_a_step_also_after_a_restart(tiny_model_dir, tmp_path):
    storage, limits = tmp_path / "storage", Limits(max_pending_forward_ops=3)
    with worker(tiny_model_dir, storage, limits=limits) as (base, _app), client(base, KEY_A) as a:
        run = native_run(a)
        for seq in (1, 2, 3):  # at the cap
            assert op(a, run, seq, fb(seq)).status_code == 200
        refused = op(a, run, 4, fb(4))  # one past it
        assert refused.status_code == 409, refused.text
        assert "too_many_pending_forward_ops" in refused.text and "--max-pending-forward-ops=3" in refused.text
        assert op(a, run, 4, OPTIM).status_code == 200  # the refused op used no seq_id
        assert op(a, run, 5, fb(5)).status_code == 200
    with worker(tiny_model_dir, storage, limits=limits) as (base, _app), client(base, KEY_A) as a:
        assert op(a, run, 6, fb(6)).status_code == 200
        assert op(a, run, 7, fb(7)).status_code == 200  # 3 since the step: the one before the restart counted
        assert op(a, run, 8, fb(8)).status_code == 409


def test_the_journal_counts_in_the_tenants_storage_budget(tiny_model_dir, tmp_path):
    budget = 200_000
    with worker(tiny_model_dir, tmp_path / "storage", storage_options=StorageOptions(
            max_storage_bytes_per_tenant=budget)) as (base, app), client(base, KEY_A) as a, client(base, KEY_B) as b:
        journal, service = app.state.service.journal, app.state.service
        run, other = native_run(a), native_run(b)
        tenant = service.runs._runs[run].tenant
        seq, answer = 0, None
        for seq in range(1, 100):
            answer = op(a, run, seq, fb(seq, 400))
            if answer.status_code != 200:
                break
        assert answer.status_code == 507 and "storage_budget_exceeded" in answer.text, answer.text
        assert "--max-storage-bytes-per-tenant" in answer.text and seq > 2
        # what was accepted fits; the results of those ops are written when they end, past the check
        (results,) = journal.db.query("SELECT COALESCE(SUM(LENGTH(result)), 0) FROM requests WHERE tenant = ?",
                                      (tenant,))[0]
        assert journal.tenant_bytes(tenant) - results <= budget < journal.tenant_bytes(tenant) - results + 30_000
        assert op(b, other, 1, fb(1, 400)).status_code == 200  # another key's budget is its own
        saved = a.post(f"/v1/training_runs/{run}/ops", json={"seq_id": seq, "payload": {
            "op": "save_state", "name": "over"}})
        assert saved.status_code in (200, 507)
        if saved.status_code == 200:  # a save is refused only once it runs: poll it
            request = saved.json()["request_id"]
            result = a.get(f"/v1/requests/{request}", params={"wait": 30})
            body = result.json()  # a poll answers 200 with the failed request and its error
            assert result.status_code == 200, result.text
            assert body["status"] == "failed" and body["error"]["code"] == "storage_budget_exceeded", result.text
            assert "--max-storage-bytes-per-tenant" in body["error"]["message"]


def test_an_op_record_at_the_room_left_is_written_and_one_byte_more_is_refused(tmp_path):
    journal = Journal(tmp_path, 60.0)
    record = {"op": "forward", "data": list(range(100))}
    size = len(records.pack(record))
    journal.db.execute("INSERT INTO runs (run_id, tenant, base_model, spec, created) VALUES ('r', 't', 'm', '{}', 0)")
    with pytest.raises(WorkerError) as err:
        journal.op_accepted("r", 1, "req-1", "forward", "h", record, room=size - 1)
    assert err.value.status == 507 and err.value.code == "storage_budget_exceeded"
    assert journal.tenant_bytes("t") == 0  # nothing written
    journal.op_accepted("r", 1, "req-1", "forward", "h", record, room=size)
    assert journal.tenant_bytes("t") == size and journal.tenant_bytes("other") == 0
    journal.close()
