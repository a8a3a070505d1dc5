"""The Tinker protocol across a worker killed with SIGKILL and started again on the same storage, spoken by hand:
with ``--durability full`` (the default) futures answer as before the crash, a re-sent seq_id or asample gets its
original future (so it runs once), later ops continue in seq_id order, and an id the crash lost is 410 (which the
SDK answers by sending a sample again); with ``--durability checkpoint-only`` everything is gone, as before."""

from __future__ import annotations

import numpy as np
import pytest
from support import WorkerProcess

from server_mock.api.tinker.futures import BOOT

from tinker_raw_client import RawTinker, fwd_body, logprobs

KEY = "secret-key"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]}


def sample_body(sampler: str, seq_id: int, seed: int = 7) -> dict:
    return {"sampling_session_id": sampler, "seq_id": seq_id, "prompt": PROMPT, "num_samples": 2,
            "sampling_params": {"max_tokens": 4, "seed": seed, "temperature": 1.0}}


@pytest.fixture()
def restartable(tiny_model_dir, tmp_path):
    workers = []

    def start(*extra: str, port: int = 0) -> WorkerProcess:
        workers.append(WorkerProcess(tiny_model_dir, tmp_path / "storage", *extra, api_keys=[KEY],
                                     warm=True).start(port))
        return workers[-1]

    yield start
    for worker in workers:
        worker.stop()


@pytest.mark.timeout(120)
def test_futures_gates_sampling_sessions_and_resends_survive_a_kill(restartable):
    worker = restartable()
    raw = RawTinker(worker.base_url, "tml-" + KEY)
    model = raw.model("tiny", seed=3)
    session = model.split(":train:")[0]
    first = raw.forward_backward(model, 1).json()["request_id"]
    step = raw.optim_step(model, 2).json()["request_id"]
    probe = raw.forward_backward(model, 3, forward_only=True).json()["request_id"]
    before = {rid: raw.result(rid) for rid in (first, step, probe)}
    sampler = raw.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                         "base_model": "tiny"}).json()["sampling_session_id"]
    sampled = raw.post("/asample", json=sample_body(sampler, 1)).json()
    sample_bytes = raw.result(sampled["request_id"])
    assert isinstance(sample_bytes, bytes)

    worker.kill()
    worker = restartable(port=worker.port)

    # every future answers as before, bit for bit
    for rid, answer in before.items():
        assert raw.result(rid) == answer
    assert raw.result(sampled["request_id"]) == sample_bytes
    # re-sent seq_ids get their original futures: nothing runs again
    assert raw.forward_backward(model, 1).json()["request_id"] == first
    assert raw.optim_step(model, 2).json()["request_id"] == step
    clash = raw.forward_backward(model, 2, forward_only=True).json()["request_id"]
    assert "different request" in raw.result(clash)["error"]
    # the next seq_id runs next, on the weights of one optimizer step (a second one would change them)
    again = raw.run_forward(model, 4, forward_only=True)
    assert np.array_equal(logprobs(again), logprobs(raw.run_forward(model, 5, forward_only=True)))
    from tinker.proto.response_conv import deserialize_forward_backward_output
    assert np.array_equal(logprobs(again), logprobs(deserialize_forward_backward_output(before[probe])))
    # the session, its sampling session and the asample (sampler, seq_id) come back
    assert raw.post("/session_heartbeat", json={"session_id": session, "type": "session_heartbeat"}).status_code == 200
    resent = raw.post("/asample", json=sample_body(sampler, 1)).json()
    assert resent == sampled
    other = raw.post("/asample", json=sample_body(sampler, 2)).json()
    assert other["request_id"] != sampled["request_id"] and raw.result(other["request_id"]) == sample_bytes
    same = raw.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                      "base_model": "tiny"}).json()["sampling_session_id"]
    assert same == sampler
    created = raw.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                              "lora_config": {"rank": 4, "seed": 3}, "type": "create_model"}).json()
    assert created["model_id"] == model and raw.result(created["request_id"])["model_id"] == model
    # an id of the process before that names nothing recorded: 410 (send it again); a malformed one: 404 as ever
    lost_id = "tk-" + ("0" * 8 if BOOT != "0" * 8 else "1" * 8) + "f" * 32
    lost = raw.post("/retrieve_future", json={"request_id": lost_id})
    assert lost.status_code == 410 and lost.json()["code"] == "request_lost_in_restart"
    assert raw.post("/retrieve_future", json={"request_id": "tk-nope"}).status_code == 404
    # what the session held is its own again: listed, and released when it finishes (its model's run is deleted)
    held = raw.http.get(raw.base + f"/sessions/{session}").json()
    assert held["sampler_ids"] == [sampler] and len(held["training_run_ids"]) == 1
    run_id = held["training_run_ids"][0]
    assert raw.http.get(raw.base + f"/training_runs/{run_id}").status_code == 200
    assert raw.post(f"/sessions/{session}/finish", json={}).status_code == 200
    assert raw.post("/get_info", json={"model_id": model}).status_code == 404
    assert raw.http.get(raw.base + f"/training_runs/{run_id}").status_code == 404
    raw.close()


@pytest.mark.timeout(120)
def test_checkpoint_only_keeps_nothing_of_the_protocol(restartable):
    worker = restartable("--durability", "checkpoint-only")
    raw = RawTinker(worker.base_url, "tml-" + KEY)
    model = raw.model("tiny", seed=3)
    session = model.split(":train:")[0]
    first = raw.forward_backward(model, 1).json()["request_id"]
    raw.result(first)
    worker.kill()
    worker = restartable("--durability", "checkpoint-only", port=worker.port)
    gone = raw.post("/retrieve_future", json={"request_id": first})
    assert gone.status_code == 404 and gone.json()["code"] == "request_not_found"
    assert raw.post("/session_heartbeat", json={"session_id": session, "type": "session_heartbeat"}).status_code == 410
    assert raw.post("/forward_backward", content=fwd_body(model, 2),
                    headers={"Content-Type": "application/x-protobuf"}).status_code == 404
    raw.close()
