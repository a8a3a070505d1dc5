"""Every body the worker reads must declare its media type: the Tinker routes take application/json
(and application/x-protobuf for forward_backward), the OpenAI routes application/json. Anything else
is a 415 naming the Content-Type header and the type expected (in OpenAI's error shape on the OpenAI
routes), and changes nothing. The official tinker and openai clients send the right types (their own
tests run them against a worker; here each makes one call)."""

from __future__ import annotations

import httpx
import openai
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

WORKER_KEY = "media-key"
TINKER_KEY = "tml-" + WORKER_KEY
TOKENS = [5, 9, 14, 200, 31, 7]
WRONG_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None)


@pytest.fixture(scope="module")
def keyed_worker(worker_factory):
    return worker_factory(api_keys=[WORKER_KEY])


def _headers(ctype: str | None, openai_key: bool = False) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {WORKER_KEY}"} if openai_key else {"X-API-Key": TINKER_KEY}
    if ctype:
        headers["Content-Type"] = ctype
    return headers


def _result(http: httpx.Client, request_id: str) -> dict:
    for _ in range(100):
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if "protobuf" in r.headers["content-type"]:  # a forward_backward's output
            return {"output": deserialize_forward_backward_output(r.content)}
        out = r.json()
        if out.get("type") != "try_again":
            return out
    raise AssertionError(f"future {request_id} never finished")


def _tinker_model(http: httpx.Client) -> str:
    session = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    created = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                      "base_model": "tiny", "lora_config": {"rank": 4}}).json()
    assert _result(http, created["request_id"]).get("model_id") == created["model_id"]
    return created["model_id"]


def _fwd_body(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    """A forward_backward body as the official client builds it."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:]})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_tinker_routes_refuse_bodies_of_other_types(keyed_worker):
    with httpx.Client(base_url=keyed_worker.base_url, headers={"X-API-Key": TINKER_KEY}, timeout=60) as http:
        model = _tinker_model(http)
        json_bodies = {
            "/api/v1/create_session": '{"tags": []}',
            "/api/v1/optim_step": f'{{"model_id": "{model}", "seq_id": 1, "adam_params": {{"learning_rate": 1}}}}',
            "/api/v1/telemetry": '{"events": []}',
            "/api/v1/retrieve_future": '{"request_id": "nope"}',
        }
        for ctype in WRONG_TYPES:
            for path, body in json_bodies.items():
                r = http.post(path, content=body, headers=_headers(ctype))
                assert r.status_code == 415, (path, ctype, r.text)
                answer = r.json()
                assert answer["code"] == "unsupported_media_type" and answer["field"] == "Content-Type", answer
                assert "Content-Type" in answer["detail"] and "application/json" in answer["detail"], answer
            for wrong in (ctype, "application/json"):
                r = http.post("/api/v1/forward_backward", content=_fwd_body(model, 1, TOKENS), headers=_headers(wrong))
                assert r.status_code == 415, (wrong, r.text)
                assert "application/x-protobuf" in r.json()["detail"] and r.json()["field"] == "Content-Type"
        # a body-less POST that announces no type is fine (there is no body to misread)
        assert httpx.post(keyed_worker.base_url + "/api/v1/client/config",
                          headers={"X-API-Key": TINKER_KEY}).status_code == 200
        # nothing was recorded: seq_id 1 of the model is still free, for a forward_backward, then an optim_step
        fwd = http.post("/api/v1/forward_backward", content=_fwd_body(model, 1, TOKENS),
                        headers={"Content-Type": "application/x-protobuf"})
        assert fwd.status_code == 200, fwd.text
        output = _result(http, fwd.json()["request_id"])["output"]
        assert len(output.loss_fn_outputs[0]["logprobs"].to_numpy()) == len(TOKENS) - 1
        step = http.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 2,
                                                     "adam_params": {"learning_rate": 1e-3}})
        assert step.status_code == 200, step.text
        out = _result(http, step.json()["request_id"])
        assert "error" not in out and out["metrics"]["step:max"] == 1, out


def test_openai_routes_refuse_bodies_of_other_types(keyed_worker):
    body = '{"model": "tiny", "prompt": [5, 6], "max_tokens": 2}'
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    with httpx.Client(base_url=keyed_worker.base_url + "/api/openai/v1", timeout=60) as http:
        for ctype in WRONG_TYPES:
            for path, content in (("/completions", body), ("/chat/completions", chat)):
                r = http.post(path, content=content, headers=_headers(ctype, openai_key=True))
                assert r.status_code == 415, (path, ctype, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"
                assert error["param"] == "Content-Type" and "application/json" in error["message"], error
        ok = http.post("/completions", content=body, headers=_headers("application/json; charset=utf-8", True))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text
    client = openai.OpenAI(base_url=keyed_worker.base_url + "/api/openai/v1", api_key=WORKER_KEY, max_retries=0)
    answer = client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2)
    assert answer.usage.completion_tokens == 2
