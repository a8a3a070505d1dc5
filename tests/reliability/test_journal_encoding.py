"""The journal records what an op's answer is as data (its front end's protocol tag and answer kind), never the
name of a Python function: an encoder renamed or moved between two workers on the same storage changes nothing,
a journal written in the earlier form (the encoder's qualified name) is still taken up, and no file under
``--storage`` holds a module path of the worker or the SDK."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch

import pytrio_compat as trio
from pytrio_compat.types.tensor import WireTensor
from server_mock.api.native import runs as native_runs
from server_mock.api.tinker import answers as tinker_answers
from server_mock.service import restore as service_restore
from server_mock.service import runs as service_runs
from server_mock.service.journal import Journal
from server_mock.service.worker import WorkerService

from .reliability_helpers import datum, serving

KEY = "journal-key"
MODULE_PATHS = (b"server_mock.", b"pytrio_compat.")


def wait_for(predicate, what: str, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def accept_only(service: WorkerService, monkeypatch) -> None:
    """Ops are accepted (journaled, acknowledged) but never run: as if the worker died right after."""
    queue = service.models.queue("tiny")
    monkeypatch.setattr(queue, "put", lambda job: None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", ["renamed", "earlier_form"])
def test_a_pending_forward_op_answers_after_a_restart(tiny_model_dir, tmp_path, monkeypatch, form):
    storage = tmp_path / "storage"
    if form == "earlier_form":  # the op is journaled as before: no front, its encoder named by its qualified name
        legacy = "server_mock.api.native.runs.encode_forward_result"
        original = Journal.op_accepted

        def old_writer(self, run_id, seq, request_id, kind, body_hash, record, front, room=None):
            if front is not None and front.get("protocol") == "native":
                record, front = {**record, "encode": legacy}, None
            return original(self, run_id, seq, request_id, kind, body_hash, record, front, room)

        monkeypatch.setattr(Journal, "op_accepted", old_writer)
    first = WorkerService({"tiny": str(tiny_model_dir)}, storage, "cpu", torch.float32)
    with serving(first, [KEY]) as url:
        client = trio.ServiceClient(api_key=KEY, base_url=url)
        try:
            tc = client.create_lora_training_client("tiny", rank=4, seed=1)
            accept_only(first, monkeypatch)
            tc.forward_backward([datum()])  # acknowledged, then the worker "dies" before it runs
            run_id = tc.get_info().training_run_id
            ops = wait_for(lambda: first.journal.ops(run_id), "the op to be journaled")
        finally:
            client.close()
    request_id = ops[0].request_id
    assert (ops[0].front is None) == (form == "earlier_form")
    if form == "renamed":  # what is journaled is data: no function is named in the op's row
        assert ops[0].front == {"protocol": "native", "answer": "forward"}
        assert b"encode_forward" not in ops[0].payload and b"server_mock." not in ops[0].payload
    monkeypatch.undo()

    # between the two workers the encoder is renamed and moved: nothing journaled names it
    encoder = native_runs.encode_forward_result
    monkeypatch.setattr(encoder, "__qualname__", "forward_tensors")
    monkeypatch.setattr(encoder, "__module__", "server_mock.api.native.encoding")
    monkeypatch.delattr(native_runs, "encode_forward_result")
    monkeypatch.setattr(tinker_answers.encode_forward, "__qualname__", "protobuf_of_forward")
    second = WorkerService({"tiny": str(tiny_model_dir)}, storage, "cpu", torch.float32)
    with serving(second, [KEY]) as url:
        answer = httpx.get(f"{url}/v1/requests/{request_id}", params={"wait": 30},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["status"] == "succeeded", body
    logprobs = WireTensor.model_validate(body["result"]["loss_fn_outputs"][0]["logprobs"]).to_array().tolist()
    assert len(logprobs) == 19 and all(lp < 0 for lp in logprobs)  # the datum's 19 target positions


def test_a_front_of_an_unknown_protocol_or_kind_encodes_nothing():
    assert service_runs.encoder_for(None) is None
    assert service_runs.encoder_for({"protocol": "elsewhere", "answer": "forward"}) is None
    assert service_runs.encoder_for({"protocol": "native", "answer": "optim"}) is None
    assert service_runs.encoder_for({"protocol": "tinker", "answer": "forward"}) is tinker_answers.encode_forward
    assert service_restore.front_of(None, {"encode": "server_mock.api.tinker.answers.encode_forward"}) == \
        {"protocol": "tinker", "answer": "forward"}
    assert service_restore.front_of(None, {"encode": "some.other.function"}) is None


def files_naming_modules(storage: Path) -> list[str]:
    found = []
    for path in sorted(p for p in storage.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.relative_to(storage)}: {name.decode()}" for name in MODULE_PATHS if name in data]
    return found


@pytest.mark.timeout(240)
def test_no_file_under_storage_names_a_python_module(tiny_model_dir, tmp_path, monkeypatch):
    import tinker
    from tinker import types

    storage = tmp_path / "storage"
    service = WorkerService({"tiny": str(tiny_model_dir)}, storage, "cpu", torch.float32)
    with serving(service, [KEY]) as url:
        warnings.simplefilter("ignore", FutureWarning)
        official = tinker.ServiceClient(base_url=url, api_key="tml-" + KEY)
        try:
            tc = official.create_lora_training_client("tiny", rank=4, seed=3)
            tokens = [(7 * i) % 480 + 10 for i in range(12)]
            row = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": tokens[1:]})
            tc.forward_backward([row], "cross_entropy").result(timeout=60)
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
            sampler = tc.save_weights_and_get_sampling_client()
            sampler.sample(types.ModelInput.from_ints(tokens[:5]), num_samples=2,
                           sampling_params=types.SamplingParams(max_tokens=3, seed=1)).result(timeout=60)
        finally:
            official.close("success").result(timeout=30)
        native = trio.ServiceClient(api_key=KEY, base_url=url)
        try:
            run = native.create_lora_training_client("tiny", rank=4, seed=1)
            run.forward_backward([datum()]).result()
            run.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
            run.save_weights_and_get_sampling_client().sample(
                trio.ModelInput.from_ints([3, 4, 5]), sampling_params=trio.SamplingParams(max_tokens=3, seed=4)
            ).result()
            run.save_state("scan").result()
        finally:
            native.close()
        written = {p.name for p in storage.rglob("*")}
        assert {"state.db", "state.db-wal"} <= written, sorted(written)  # the database, as it is while open
        assert files_naming_modules(storage) == []
    assert files_naming_modules(storage) == []
