"""A torn last write: after a kill, the newest state file of a run is corrupted (cut short, or a flipped byte); the
restarted worker detects it by its SHA-256, takes the state before it and runs the ops after that one again, so the
run ends bit-identical to one that was never interrupted. Files a crash left behind are collected at start."""

from __future__ import annotations

import sqlite3

import pytest
from support import WorkerProcess

import pytrio_compat as trio

from .reliability_helpers import datum, saved_state

ADAM = trio.AdamParams(learning_rate=1e-2)


def steps(tc, first: int, last: int) -> None:
    for step in range(first, last):
        tc.forward_backward([datum(step)]).result()
        tc.optim_step(ADAM).result()


def newest_state(storage) -> tuple[str, str | None]:
    db = sqlite3.connect(storage / "durable" / "state.db")
    try:
        return db.execute("SELECT state_file, prev_file FROM runs").fetchone()
    finally:
        db.close()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_torn_newest_state_falls_back_to_the_one_before(damage, tiny_model_dir, tmp_path, fast_retries,
                                                       client_cache):
    control = WorkerProcess(tiny_model_dir, tmp_path / "control").start()
    client = trio.ServiceClient(base_url=control.base_url)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=3)
        steps(tc, 0, 4)
        expected = saved_state(tmp_path / "control", tc)
    finally:
        client.close()
        control.stop()

    storage = tmp_path / "storage"
    worker = WorkerProcess(tiny_model_dir, storage).start()
    client = trio.ServiceClient(base_url=worker.base_url)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=3)
        steps(tc, 0, 3)
        tc.forward_backward([datum(3)]).result()  # pending gradients, recomputed at recovery
        worker.kill()
        newest, previous = newest_state(storage)
        assert previous is not None
        target = storage / "durable" / "files" / newest
        data = bytearray(target.read_bytes())
        if damage == "truncate":
            target.write_bytes(bytes(data[: len(data) // 2]))
        else:
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))
        # what a crash leaves: a temporary file, a state file no row names, a half-written checkpoint folder
        leftovers = [storage / "durable" / "files" / "runs" / ".state.bin.tmp-abc",
                     storage / "durable" / "files" / "runs" / "stray-state.bin"]
        for path in leftovers:
            path.write_bytes(b"junk")
        half_saved = storage / "checkpoints" / tc.training_run_id / "state" / ".final.tmp-xyz"
        half_saved.mkdir(parents=True)
        (half_saved / "adapter_model.safetensors").write_bytes(b"junk")

        worker = WorkerProcess(tiny_model_dir, storage).start(worker.port)
        tc.optim_step(ADAM).result(timeout=60)
        assert saved_state(storage, tc) == expected
        assert not any(path.exists() for path in leftovers) and not half_saved.exists()
        assert "is missing or torn; using the one before" in (tmp_path / "worker.log").read_text()
    finally:
        client.close()
        worker.stop()
