"""A re-sent request is told from a different one by the bytes of its body (``api.endpoint.fingerprint``), in
the native and the Tinker protocols: the same bytes are a resend (the first request's answer), a body that
differs in any byte under the same seq_id is a conflict, and the parsed model is never re-serialised to hash it."""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient

from server_mock.api.endpoint import fingerprint
from server_mock.api.tinker.schemas import OptimStep
from server_mock.app import create_app
from server_mock.config import StorageOptions
from server_mock.service.worker import WorkerService


def test_fingerprint_is_the_sha256_of_the_bytes():
    import hashlib

    assert fingerprint(b'{"a": 1}') == hashlib.sha256(b'{"a": 1}').hexdigest()
    assert fingerprint(b'{"a": 1}') != fingerprint(b'{"a":1}')


def test_a_tinker_body_digest_is_that_of_its_bytes():
    raw = b'{"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": 0.001}}'
    body = OptimStep.model_validate_json(raw)
    made_here = body.digest()  # not read from bytes: its JSON
    body.received(fingerprint(raw))
    assert body.digest() == fingerprint(raw) != made_here


@pytest.mark.timeout(120)
def test_a_native_resend_is_the_same_bytes(tiny_model_dir, tmp_path):
    service = WorkerService({"tiny": str(tiny_model_dir)}, tmp_path / "storage", "cpu", torch.float32,
                            storage_options=StorageOptions(durability="checkpoint-only"))
    with TestClient(create_app(service), base_url="http://127.0.0.1") as http:
        run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2}})
        assert run.status_code == 200, run.text
        ops = f"/v1/training_runs/{run.json()['training_run_id']}/ops"
        op = {"seq_id": 1, "payload": {"op": "optim_step", "adam_params": {"learning_rate": 0.001}}}
        raw = json.dumps(op).encode()
        headers = {"content-type": "application/json"}
        first = http.post(ops, content=raw, headers=headers).json()
        again = http.post(ops, content=raw, headers=headers).json()
        assert again == {**first, "duplicate": True}
        spaced = http.post(ops, content=json.dumps(op, indent=1).encode(), headers=headers)  # same op, other bytes
        assert spaced.status_code == 409 and spaced.json()["error"]["code"] == "seq_id_conflict", spaced.text
