"""--max-storage-bytes-per-tenant: a save that would take an API key's checkpoints and journal past it is refused
(507 naming the flag) before anything is written, exactly at the limit it is taken; and a disk that refuses a write
leaves no checkpoint half written."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file
from support import InProcessWorker

import pytrio_compat as trio
from pytrio_compat.errors import PyTrioError

from pytrio_compat.wire import SaveOp
from server_mock.service.journal import Journal
from server_mock.storage import records

from .reliability_helpers import datum


def folder_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def tensor_bytes(folder) -> int:
    return sum(a.nbytes for name in ("adapter_model.safetensors", "optimizer.safetensors")
               for a in load_file(str(folder / name)).values())


@pytest.mark.parametrize("past", [0, 1])
def test_budget_refuses_a_save_past_it_and_takes_one_at_it(past, tiny_model_dir, tmp_path, fast_retries,
                                                           client_cache):
    storage = tmp_path / "storage"
    worker = InProcessWorker(tiny_model_dir, storage).start()
    client = trio.ServiceClient(base_url=worker.base_url)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=2)
        tc.forward_backward([datum()]).result()
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
        first = storage / "checkpoints" / tc.save_state("a").result().path[len("trio://"):]
        worker.stop()
        journal = Journal(storage, 3600.0)
        journaled = journal.tenant_bytes("default")  # the journal counts too: the run's state, ops, results
        journal.close()
        save_record = len(records.pack({"op": "SaveOp", "body": SaveOp(op="save_state", name="b").model_dump(
            mode="json")}))  # journaled when the save is accepted, before it runs
        # what "a" and the journal hold + what "b" will need
        budget = folder_bytes(first) + tensor_bytes(first) + journaled + save_record - past

        worker = InProcessWorker(tiny_model_dir, storage, "--max-storage-bytes-per-tenant", str(budget)).start(
            worker.port)
        second = first.with_name("b")
        if past:
            with pytest.raises(PyTrioError) as err:
                tc.save_state("b").result(timeout=30)
            assert err.value.code == "storage_budget_exceeded"
            assert "--max-storage-bytes-per-tenant" in str(err.value)
            assert not second.exists() and not list(second.parent.glob(".b*"))
            # the run itself is unharmed: the budget still has room for an op
            assert tc.forward_backward([datum(1)]).result(timeout=30).metrics["token_count"] == 19.0
        else:
            tc.save_state("b").result(timeout=30)
            assert second.exists()
            with pytest.raises(PyTrioError) as err:  # the budget is spent: the next op's record is refused
                tc.forward_backward([datum(1)]).result(timeout=30)
            assert err.value.code == "storage_budget_exceeded" and "--max-storage-bytes-per-tenant" in str(err.value)
    finally:
        client.close()
        worker.stop()


def test_a_full_disk_is_a_clear_507_and_nothing_half_written(tiny_model_dir, tmp_path, monkeypatch, fast_retries,
                                                             client_cache):
    import errno

    from server_mock.service import journal as journal_module
    from server_mock.storage import checkpoints

    from .reliability_helpers import in_process_worker

    full = {"on": False}

    def refusing(real):
        def write(*args, **kwargs):
            if full["on"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args, **kwargs)
        return write

    accept = journal_module.Journal.op_accepted
    monkeypatch.setattr(checkpoints, "save_file", refusing(checkpoints.save_file))
    monkeypatch.setattr(journal_module.Journal, "op_accepted", refusing(accept))
    storage = tmp_path / "storage"
    with in_process_worker(tiny_model_dir, storage) as url:
        client = trio.ServiceClient(base_url=url)
        try:
            tc = client.create_lora_training_client("tiny", rank=4, seed=2)
            tc.forward_backward([datum()]).result()
            full["on"] = True
            with pytest.raises(PyTrioError) as err:  # accepting the op could not be recorded: refused, seq_id free
                tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result(timeout=30)
            assert err.value.status_code == 507 and err.value.code == "storage_full"
            assert "nothing was changed" in str(err.value)
            full["on"] = False  # space again: the same client carries on, with the seq_id the refused op did not use
            assert tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result(timeout=30).metrics["step"] == 1.0
            monkeypatch.setattr(journal_module.Journal, "op_accepted", accept)
            full["on"] = True
            with pytest.raises(PyTrioError) as err:  # the checkpoint's files: refused, no folder left
                tc.save_state("full-disk").result(timeout=30)
            assert err.value.code == "storage_full" and "--storage" in str(err.value)
            assert not list((storage / "checkpoints" / tc.training_run_id).rglob("*full-disk*"))
            full["on"] = False
            assert tc.save_state("full-disk").result(timeout=30).path.endswith("/state/full-disk")
        finally:
            client.close()
