"""Checkpoint files are read on worker threads (or the model's thread), never on the event loop that
answers every client: a large checkpoint being read must not stall other requests.

The worker runs in this process (real uvicorn, real HTTP) so that the store's reads can be watched."""

from __future__ import annotations

import httpx
import pytest

from server_mock.storage.checkpoints import CheckpointStore

from .reliability_helpers import datum_wire, in_process_worker, on_event_loop


@pytest.fixture()
def watched_worker(tiny_model_dir, tmp_path, monkeypatch):
    """An in-process worker whose checkpoint reads record whether they ran on the event loop."""
    reads: list[tuple[str, bool]] = []
    for name in ("read_tensors", "read_meta", "exists", "list"):
        original = getattr(CheckpointStore, name)

        def watched(self, *args, _original=original, _name=name, **kwargs):
            reads.append((_name, on_event_loop()))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(CheckpointStore, name, watched)
    with in_process_worker(tiny_model_dir, tmp_path / "storage") as base:
        yield base, reads


def test_checkpoints_are_never_read_on_the_event_loop(watched_worker):
    base, reads = watched_worker
    with httpx.Client(base_url=base, timeout=60) as http:
        def done(request_id: str) -> dict:
            status = http.get(f"/v1/requests/{request_id}", params={"wait": 30}).json()
            assert status["status"] == "succeeded", status
            return status["result"]

        run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).json()["training_run_id"]
        ops = [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum_wire()]},
               {"op": "optim_step", "adam_params": {"learning_rate": 1e-2}},
               {"op": "save_weights_for_sampler", "name": "w"},
               {"op": "save_state", "name": "s"}]
        paths = []
        for seq, payload in enumerate(ops, start=1):
            accepted = http.post(f"/v1/training_runs/{run}/ops", json={"seq_id": seq, "payload": payload}).json()
            paths.append(done(accepted["request_id"]).get("path"))
        weights, state = paths[2], paths[3]
        reads.clear()
        sampler = http.post("/v1/samplers", json={"model_path": weights}).json()["sampler_id"]
        sample = http.post(f"/v1/samplers/{sampler}/sample",
                           json={"prompt_tokens": [5, 6], "sampling_params": {"max_tokens": 2}}).json()
        done(sample["request_id"])
        resumed = http.post("/v1/training_runs", json={"from_checkpoint": state}).json()
        assert resumed["training_run_id"], resumed
        assert http.get("/v1/checkpoint_config", params={"path": state}).json()["kind"] == "state"
        assert len(http.get("/v1/checkpoints").json()["checkpoints"]) == 2
        assert http.delete("/v1/checkpoints", params={"path": weights}).json() == {"deleted": True}
    kinds = {name for name, _ in reads}
    assert {"read_tensors", "read_meta", "list"} <= kinds  # the flows above did read the disk
    on_loop = [name for name, loop in reads if loop and name != "exists"]  # a stat may answer a 404 at once
    assert on_loop == [], on_loop


def test_model_listings_and_weights_info_read_the_disk_off_the_event_loop(watched_worker):
    """OpenAI ``/models`` (which lists the caller's sampler checkpoints) and Tinker ``weights_info`` read
    checkpoint metadata in a worker thread: their cost grows with the checkpoints on disk, and it must not stall
    the loop every tenant's requests go through."""
    base, reads = watched_worker
    with httpx.Client(base_url=base, timeout=60) as http:
        run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2}}).json()["training_run_id"]
        paths = []
        for seq, payload in enumerate([{"op": "save_weights_for_sampler", "name": "w"},
                                       {"op": "save_state", "name": "s"}], start=1):
            rid = http.post(f"/v1/training_runs/{run}/ops", json={"seq_id": seq, "payload": payload}).json()
            paths.append(http.get(f"/v1/requests/{rid['request_id']}", params={"wait": 30}).json()["result"]["path"])
        reads.clear()
        models = http.get("/api/openai/v1/models").json()["data"]
        assert [m["parent"] for m in models if m["id"] == paths[0]] == ["tiny"], models
        assert http.get(f"/api/openai/v1/models/{paths[0]}").json()["id"] == paths[0]
        info = http.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{run}/weights/s"})
        assert info.status_code == 200 and info.json()["lora_rank"] == 2, info.text
    assert {name for name, _ in reads} >= {"list", "read_meta"}
    assert [name for name, loop in reads if loop] == []
