"""Who may read the operator's routes, and that an operator key is no tenant: on an in-process app (no model runs).

/metrics, /operator/state and the traces: 200 to an admin key (X-Admin-Key or a bearer token), 401 without a key or
with an unknown one, 403 to a tenant's API key, 404 on a worker without admin keys. /console loads without a key (404
without admin keys). An admin key on any tenant route of any protocol: 403 admin_key_not_a_tenant.
"""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from server_mock.api.auth import Auth, parse_key_lines, tenant_id
from server_mock.app import create_app
from server_mock.service.worker import WorkerService

from .operator_support import ADMIN, ADMIN_KEY, OTHER_KEY, TENANT_KEY

DATA_ROUTES = ["/metrics", "/operator/state", "/operator/traces/scope/run-0123456789abcdef",
               "/operator/traces/session/sess-1"]


@pytest.fixture()
def app_client(tiny_model_dir, tmp_path):
    def make(admin_keys=(ADMIN_KEY,), keys=(TENANT_KEY, OTHER_KEY)) -> TestClient:
        service = WorkerService({"tiny": str(tiny_model_dir)}, tmp_path / "storage", "cpu", torch.float32)
        return TestClient(create_app(service, list(keys), admin_keys=list(admin_keys)), base_url="http://127.0.0.1")

    return make


@pytest.mark.parametrize("path", DATA_ROUTES)
def test_operator_data_answers_admin_only(app_client, path):
    with app_client() as client:
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"x-admin-key": "operator-key-0124"}).status_code == 401  # one char off
        tenant = client.get(path, headers={"authorization": f"Bearer {TENANT_KEY}"})
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "not_an_admin_key"
        assert client.get(path, headers={"x-api-key": OTHER_KEY}).status_code == 403
        admin = client.get(path, headers=ADMIN)
        bearer = client.get(path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        # a trace of nothing is a 404 of its own (nothing kept), never an auth answer
        expected = 404 if "traces" in path else 200
        assert admin.status_code == bearer.status_code == expected
        if expected == 404:
            assert admin.json()["error"]["code"].endswith("not_traced") or admin.json()["error"]["code"] == (
                "session_not_found")


@pytest.mark.parametrize("path", [*DATA_ROUTES, "/console"])
def test_without_admin_keys_the_operator_routes_are_404(app_client, path):
    with app_client(admin_keys=()) as client:
        for headers in ({}, ADMIN, {"authorization": f"Bearer {TENANT_KEY}"}):
            answer = client.get(path, headers=headers)
            assert answer.status_code == 404, (path, headers)
            assert "--admin-key-file" in answer.json()["error"]["message"]


def test_console_page_loads_without_a_key_and_fetches_nothing_from_elsewhere(app_client):
    with app_client() as client:
        page = client.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<script" in html and "src=" not in html.split("<script", 1)[1].split(">", 1)[0]  # inline, no src
    assert "http://" not in html and "https://" not in html  # no CDN, no link out
    assert "sessionStorage" in html and "X-Admin-Key" in html
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy


def test_a_cross_site_page_cannot_read_the_console_data(app_client):
    """The browser guard is unchanged: a request from a foreign origin is refused before auth, even with the key."""
    with app_client() as client:
        foreign = client.get("/operator/state", headers={**ADMIN, "origin": "http://evil.example"})
        rebound = client.get("/operator/state", headers={**ADMIN, "host": "evil.example"})
        same = client.get("/operator/state", headers={**ADMIN, "origin": "http://127.0.0.1"})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "forbidden_origin"
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden_host"
    assert same.status_code == 200


TENANT_ROUTES = [  # (method, path, headers with the admin key as that protocol's client sends a key)
    ("GET", "/v1/whoami", {"authorization": f"Bearer {ADMIN_KEY}"}),
    ("GET", "/v1/capabilities", {"x-api-key": ADMIN_KEY}),
    ("GET", "/api/v1/get_server_capabilities", {"x-api-key": "tml-" + ADMIN_KEY}),  # Tinker's tml- form
    ("GET", "/api/v1/get_server_capabilities", {"x-api-key": ADMIN_KEY}),
    ("GET", "/api/openai/v1/models", {"authorization": f"Bearer {ADMIN_KEY}"}),
    ("GET", "/api/openapi/v1/api-key/verify", {"x-api-key": ADMIN_KEY}),
]


@pytest.mark.parametrize("method,path,headers", TENANT_ROUTES)
def test_an_admin_key_is_refused_on_tenant_routes(app_client, method, path, headers):
    with app_client() as client:
        refused = client.request(method, path, headers=headers)
        allowed = client.request(method, path, headers={k: v.replace(ADMIN_KEY, TENANT_KEY) for k, v in
                                                       headers.items()})
    assert refused.status_code == 403, refused.text
    assert "admin_key_not_a_tenant" in refused.text
    assert allowed.status_code == 200, allowed.text


def test_an_admin_key_is_refused_even_on_a_worker_without_api_keys(app_client):
    with app_client(keys=()) as client:
        assert client.get("/v1/whoami").json() == {"tenant": "default"}
        assert client.get("/v1/whoami", headers={"authorization": f"Bearer {ADMIN_KEY}"}).status_code == 403
        assert client.get("/metrics", headers=ADMIN).status_code == 200


def test_a_key_cannot_be_both_a_tenant_and_an_operator():
    with pytest.raises(ValueError, match="both an API key and an admin key"):
        Auth([TENANT_KEY], [TENANT_KEY])


def test_key_files_carry_a_budget_per_key_and_never_echo_a_key():
    parsed = parse_key_lines("# lab keys\nalpha-key tokens_per_minute=6000\n\nbeta-key   # no budget\n", "f")
    assert parsed == [("alpha-key", {"tokens_per_minute": 6000}), ("beta-key", {})]
    with pytest.raises(ValueError) as refused:
        parse_key_lines("first-key\nsecret part-of-a-key\n", "keys.txt")
    assert "keys.txt line 2" in str(refused.value) and "part-of-a-key" not in str(refused.value)
    with pytest.raises(ValueError, match="line 1"):
        parse_key_lines("k tokens_per_minute=-5\n", "f")
    assert tenant_id("alpha-key").startswith("tenant-") and "alpha" not in tenant_id("alpha-key")


def test_the_cli_reads_admin_keys_from_the_environment_and_refuses_a_key_in_both_lists(tmp_path):
    import os
    import subprocess
    import sys

    keys = tmp_path / "keys.txt"
    keys.write_text(f"{TENANT_KEY}\n")
    keys.chmod(0o600)
    env = {**os.environ, "PYTRIO_WORKER_ADMIN_KEYS": f"{ADMIN_KEY},{TENANT_KEY}"}
    done = subprocess.run([sys.executable, "-m", "server_mock", "serve", "--model", "tiny=/nonexistent",
                           "--api-key-file", str(keys)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "both an API key and an admin key" in done.stderr
    assert TENANT_KEY not in done.stderr and ADMIN_KEY not in done.stderr
    bad = tmp_path / "admins.txt"
    bad.write_text(f"{ADMIN_KEY} weight=2\n")
    done = subprocess.run([sys.executable, "-m", "server_mock", "serve", "--model", "tiny=/nonexistent",
                           "--admin-key-file", str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "line 1" in done.stderr and ADMIN_KEY not in done.stderr
