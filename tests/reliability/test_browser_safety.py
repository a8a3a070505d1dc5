"""A web page must not drive a worker through the user's browser: JSON bodies need Content-Type
application/json (a cross-site form or text/plain POST is refused with 415), and a foreign Host (DNS
rebinding) or Origin is refused with 403 naming the header and --allowed-host. The SDK and the official
tinker and openai clients send none of those and keep working. /v1/health tells a caller without a key
only that the worker is alive."""

from __future__ import annotations

import httpx
import openai
import pytest

from .reliability_helpers import KEY_A

BODY = '{"base_model": "tiny", "lora": {"rank": 4}}'


@pytest.fixture(scope="module")
def named_worker(worker_factory):
    """A keyless worker that also answers to the name my-box.lan."""
    return worker_factory("--allowed-host", "my-box.lan")


def test_json_routes_refuse_other_content_types(worker):
    with httpx.Client(base_url=worker.base_url, timeout=30) as http:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": ctype} if ctype else {}
            for path, body in (("/v1/training_runs", BODY), ("/v1/samplers", '{"base_model": "tiny"}')):
                response = http.post(path, content=body, headers=headers)
                assert response.status_code == 415, (ctype, response.text)
                error = response.json()["error"]
                assert error["field"] == "Content-Type" and "application/json" in error["message"], error
        ok = http.post("/v1/training_runs", content=BODY, headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200, ok.text


def test_foreign_host_and_origin_are_refused(worker):
    port = worker.port
    with httpx.Client(base_url=worker.base_url, timeout=30) as http:
        for host in ("attacker.example", f"attacker.example:{port}", f"rebound.evil:{port}", "10.0.0.7.nip.io"):
            response = http.get("/v1/capabilities", headers={"Host": host})
            assert response.status_code == 403, (host, response.text)
            assert "Host" in response.text and "--allowed-host" in response.text
            # every API family sits behind the same guard
            assert http.post("/api/v1/create_session", json={}, headers={"Host": host}).status_code == 403
            assert http.get("/api/openai/v1/models", headers={"Host": host}).status_code == 403
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.2"):
            assert http.get("/v1/capabilities", headers={"Host": host}).status_code == 200, host

        for origin in ("http://attacker.example", "https://evil.test:8443", "null", f"http://localhost:{port + 1}"):
            response = http.post("/v1/training_runs", content=BODY,
                                 headers={"Origin": origin, "Content-Type": "application/json"})
            assert response.status_code == 403, (origin, response.text)
            assert "Origin" in response.text and "--allowed-host" in response.text
        same = http.get("/v1/capabilities", headers={"Origin": f"http://127.0.0.1:{port}"})
        assert same.status_code == 200, same.text


def test_allowed_host_names_are_accepted(named_worker):
    with httpx.Client(base_url=named_worker.base_url, timeout=30) as http:
        port = named_worker.port
        assert http.get("/v1/capabilities", headers={"Host": f"my-box.lan:{port}"}).status_code == 200
        assert http.get("/v1/capabilities", headers={"Host": "MY-BOX.LAN."}).status_code == 200
        assert http.get("/v1/capabilities", headers={"Origin": "https://my-box.lan"}).status_code == 200
        assert http.get("/v1/capabilities", headers={"Host": f"other-box.lan:{port}"}).status_code == 403


def test_official_clients_pass_the_guard(worker, service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=1)  # the SDK
    assert tc.training_run_id
    client = openai.OpenAI(base_url=worker.base_url + "/api/openai/v1", api_key="unused", max_retries=0)
    assert "tiny" in [m.id for m in client.models.list().data]


def test_health_without_a_key_is_liveness_only(special_worker):
    anonymous = httpx.get(special_worker.base_url + "/v1/health", timeout=30)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    wrong = httpx.get(special_worker.base_url + "/v1/health", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.json() == {"status": "ok"}
    keyed = httpx.get(special_worker.base_url + "/v1/health", headers={"Authorization": f"Bearer {KEY_A}"},
                      timeout=30).json()
    assert keyed["status"] == "ok" and isinstance(keyed["models_loaded"], list)
