"""What every protocol shares (server_mock/api/endpoint.py). A re-sent request is told from a different one by the
bytes of its body (``fingerprint``), in the native and the Tinker protocols: the same bytes are a resend (the first
request's answer), a body that differs in any byte under the same seq_id is a conflict, and the parsed model is
never re-serialised to hash it. Every protocol's 429 carries ``Retry-After``; ``carries_body`` decides by method
and headers which requests have a body whose media type is checked."""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient

from server_mock.api import endpoint as api_endpoint
from server_mock.api.endpoint import carries_body, fingerprint
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


def test_every_renderer_s_429_gets_retry_after_and_others_do_not():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from server_mock.errors import WorkerError

    async def busy(request, tenant):
        raise WorkerError(429, "busy", "retry later")

    async def bad(request, tenant):
        raise WorkerError(400, "bad", "no")

    def render(exc):  # a protocol's renderer that adds no header of its own
        return JSONResponse({"code": exc.code}, status_code=exc.status)

    def route(path, handler):
        return Route(path, api_endpoint.endpoint(handler, tenant_of=lambda r: "t", render_error=render))

    with TestClient(Starlette(routes=[route("/busy", busy), route("/bad", bad)])) as http:
        assert http.get("/busy").headers["retry-after"] == "1"
        assert "retry-after" not in http.get("/bad").headers


def test_carries_body_by_method_and_headers():
    from starlette.requests import Request

    def request(method, headers):
        return Request({"type": "http", "method": method, "headers": [(k.encode(), v.encode()) for k, v in headers],
                        "path": "/", "query_string": b""})

    assert not carries_body(request("GET", [("content-length", "5")]))
    assert carries_body(request("DELETE", [("content-length", "5")]))
    assert not carries_body(request("DELETE", [("content-length", "5")]), ("GET", "HEAD", "OPTIONS", "DELETE"))
    assert carries_body(request("POST", [("content-type", "application/json")]))
    assert carries_body(request("POST", [("transfer-encoding", "chunked")]))
    assert not carries_body(request("POST", [("content-length", "0")]))
    assert not carries_body(request("POST", []))
