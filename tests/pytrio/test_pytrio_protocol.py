"""The PyTRIO protocol under input the SDK never sends, against a real worker: hostile msgpack bodies, bad and
foreign credentials, malformed events (answered as failed events naming the field), re-sent and out-of-order
events, connections cut mid-request, the per-key bounds at their limit and one past, long samples kept alive, and
download URLs that were tampered with. The worker keeps serving through all of it."""

from __future__ import annotations

import base64

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import msgpack
import pytest
from pytrio_raw import MSGPACK, RawClient, Session, datum, envelope, event_id, totals

pytest.importorskip("pytrio", reason="the official pytrio SDK (the dev extra) is not installed")

KEY_A, KEY_B, KEY_C = "proto-a", "proto-b", "proto-c"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TOKENS = [5, 17, 200, 31, 8, 99, 140, 3]


@pytest.fixture(scope="module")
def worker(worker_factory):
    return worker_factory("--pytrio-max-sampling-runs", "2", "--pytrio-max-sessions", "3", "--max-training-runs", "4",
                          "--pytrio-sample-keepalive", "0.05", "--max-body-bytes", str(4 << 20),
                          api_keys=[KEY_A, KEY_B, KEY_C])


@pytest.fixture(scope="module")
def model_id(tiny_model_dir):
    return str(tiny_model_dir.resolve())


@pytest.fixture()
def raw_a(worker):
    client = RawClient(worker.base_url, KEY_A)
    yield client
    client.close()


@pytest.fixture()
def raw_b(worker):
    client = RawClient(worker.base_url, KEY_B)
    yield client
    client.close()


def fb(tokens=TOKENS, loss="cross_entropy", **extra) -> dict:
    targets = tokens[1:] + [-100]
    body = {"data": [datum(tokens, targets)], "auto_shift": False, "loss": {"type": loss, "config": {}},
            "gradient_accumulation": totals(1, len(tokens) - 1)}
    return {**body, **extra}


def initialised(session: Session, model_id: str):
    run = session.training_run()
    assert run.init(model_id)["status"] == "succeeded"
    return run


def test_unknown_routes_answer_404_at_once(worker):
    with httpx.Client(base_url=worker.base_url, timeout=5) as http:  # liveness bound: never the SDK's 15-min retry
        for method, path in [("GET", "/api/openapi/v1/nothing/here"), ("POST", "/api/sdk/other"),
                             ("GET", "/pytrio-actor/v1/unknown"), ("DELETE", "/pytrio-actor/v2/events")]:
            response = http.request(method, path, headers={"X-API-Key": KEY_A})
            assert response.status_code == 404, (path, response.text)
            assert response.json()["code"] == "not_found"
        assert http.get("/api/sdk/bootstrap", params={"sdk_version": "0.2.9"},
                        headers={"X-API-Key": KEY_A}).json()["compatibility"]["status"] == "compatible"
        assert http.head("/").status_code < 500  # the SDK's connectivity probe


def test_keys_and_tokens_are_checked_and_tenants_see_only_their_own(worker, raw_a, raw_b, model_id):
    with httpx.Client(base_url=worker.base_url, timeout=10) as http:
        bad = http.get("/api/openapi/v1/api-key/verify", headers={"X-API-Key": "wrong"})
        assert (bad.status_code, bad.json()["code"]) == (401, "unauthorized")
        events = http.post("/pytrio-actor/v1/events", content=b"\x80", headers={  # an API key is no actor token
            "Authorization": f"Bearer {KEY_A}", "Content-Type": MSGPACK})
        assert (events.status_code, events.json()["code"]) == (401, "invalid_token")
    assert raw_a.control("GET", "/api-key/verify").json()["workspace_cuid"] != \
        raw_b.control("GET", "/api-key/verify").json()["workspace_cuid"]
    with Session(raw_a) as session:
        run = initialised(session, model_id)
        other = session.training_run()
        sampler = session.sampling_run()
        saved = run.run("trainer.save_state", {"name": "mine"})["result"]["checkpoint"]
        sampler_cuid = sampler["sampling_run_cuid"]
        for method, path in [("GET", f"/training-runs/{run.cuid}"), ("POST", f"/training-runs/{run.cuid}/renew"),
                             ("GET", f"/service-sessions/{session.cuid}"), ("GET", f"/sampling-runs/{sampler_cuid}"),
                             ("GET", f"/checkpoints/{saved['checkpoint_cuid']}/download-url"),
                             ("DELETE", f"/checkpoints/{saved['checkpoint_cuid']}"),
                             ("GET", "/training-runs/by-checkpoint-uri?checkpoint_uri=" + saved["uri"])]:
            response = raw_b.control(method, path)
            assert response.status_code == 404, (path, response.text)  # not 403: not even seen to exist
        assert raw_b.control("GET", f"/training-runs/{run.cuid}/checkpoints").json()["checkpoints"] == []
        assert saved["uri"] in [c["checkpoint_uri"] for c in raw_a.control("GET", "/checkpoints").json()["checkpoints"]]
        # a token opens its own run only: not a sibling run of the same key, not a sampling run
        foreign = msgpack.packb(envelope("trainer.forward", fb(), run.index, other.cuid), use_bin_type=True)
        assert run.submit_bytes(foreign).status_code == 404
        sample = raw_a.http.post(f"/pytrio-actor/v1/sampling-runs/{sampler['sampling_run_cuid']}/sample",
                                 headers={"Authorization": f"Bearer {run.token}"}, json={})
        assert sample.status_code == 404
        assert run.run("trainer.forward", fb())["status"] == "succeeded"  # and the run still works


def test_hostile_bodies_are_refused_and_change_nothing(raw_a, model_id):
    with Session(raw_a) as session:
        run = initialised(session, model_id)
        index = run.index
        good = msgpack.packb(envelope("trainer.forward", fb(), index, run.cuid), use_bin_type=True)
        cases = [
            (b"\x91" * 17 + b"\xc0", 400, "body_too_deep"),
            (b"\xdd\xff\xff\xff\xff", 400, "invalid_msgpack"),  # an array declaring 4 G elements
            (good + b"\x00", 400, "invalid_msgpack"),  # trailing bytes
            (good[:-3], 400, "invalid_msgpack"),  # truncated
            (msgpack.packb(msgpack.ExtType(3, b"zz")), 400, "invalid_msgpack"),
            (msgpack.packb([1, 2, 3]), 400, "invalid_event"),
            (msgpack.packb({**envelope("trainer.forward", fb(), index, run.cuid), "version": 2}), 400,
             "invalid_event"),
            (msgpack.packb({"payload": {"x": b"x" * (5 << 20)}}, use_bin_type=True), 413, "body_too_large"),
        ]
        for body, status, code in cases:
            response = run.submit_bytes(body)
            assert (response.status_code, response.json()["code"]) == (status, code), (body[:16], response.text)
        assert run.submit_bytes(good, content_type="application/json").status_code == 415
        answer = msgpack.unpackb(run.submit_bytes(good).content)  # nothing above used up the index
        assert answer["status"] in ("accepted", "running", "succeeded")


def test_bad_events_fail_naming_the_field_and_the_run_goes_on(raw_a, model_id):
    with Session(raw_a) as session:
        run = session.training_run()
        early = run.submit("trainer.forward", fb())
        assert (early["status"], early["error"]["code"]) == ("failed", "run_not_initialized")
        wrong = run.init("/not/the/model")
        assert (wrong["status"], wrong["error"]["code"]) == ("failed", "model_mismatch")
        assert run.init(model_id)["status"] == "succeeded"  # init is sent again after a failure, and works
        again = run.init(model_id)
        assert again["error"]["code"] == "already_initialized"
        short = fb()
        short["data"][0]["target_ids"] = short["data"][0]["target_ids"][:-1]
        image = fb()
        image["data"][0]["model_input"]["chunks"].append({"type": "image", "data": b"\x89PNG", "format": "png",
                                                          "expected_tokens": 1})
        image["data"][0]["target_ids"].append(-100)
        cases = [
            (short, "invalid_payload", "target_ids has 7 entries"),
            ({**fb(), "loss": {"type": "ppo", "config": {}}}, "invalid_payload", "needs logprobs and advantages"),
            ({**fb(), "loss": {"type": "cross_entropy", "config": {"beta": 1.0}}}, "invalid_loss",
             "loss_fn_config.beta"),
            (fb(tokens=[5, 900, 7]), "token_id_out_of_range", "data[0].tokens"),
            (fb(gradient_accumulation=totals(1, 99)), "invalid_payload", "gradient_accumulation"),
            (fb(gradient_accumulation=totals(0, 7)), "invalid_payload", "total_samples"),
            (image, "unsupported_input", "is text-only"),
            ({**fb(), "extra": 1}, "invalid_payload", "payload.extra"),
        ]
        for payload, code, words in cases:  # refused at submit, or when its turn comes (the worker's own checks)
            answer = run.run("trainer.forward_backward", payload)
            assert answer["status"] == "failed" and answer["error"]["code"] == code, (code, answer)
            assert words in answer["error"]["message"], answer["error"]["message"]
            assert answer["usage"]["input_tokens"] >= 0
        bad_save = run.submit("trainer.save_state", {"name": "../escape"})
        assert bad_save["error"]["code"] == "invalid_payload" and "payload.name" in bad_save["error"]["message"]
        assert run.run("trainer.forward_backward", fb())["status"] == "succeeded"


def test_a_resent_event_answers_its_status_and_never_runs_twice(raw_a, model_id):
    with Session(raw_a) as session:
        run = initialised(session, model_id)
        assert run.run("trainer.forward_backward", fb())["status"] == "succeeded"
        eid = event_id()
        first = run.run("trainer.optimize_step", {"adam_params": ADAM}, eid=eid)
        resent = run.submit("trainer.optimize_step", {"adam_params": ADAM}, eid=eid, index=run.index - 1)
        assert resent == first and first["result"]["metrics"]["step"] == 1.0
        conflict = run.submit_bytes(msgpack.packb(envelope("trainer.optimize_step", {"adam_params": {**ADAM,
                                                           "learning_rate": 0.5}}, run.index, run.cuid, eid)))
        assert (conflict.status_code, conflict.json()["code"]) == (409, "event_exists")
        late = run.submit("trainer.forward", fb(), index=run.index + 3)
        assert (late["status"], late["error"]["code"]) == ("failed", "out_of_order")
        run.run("trainer.forward_backward", fb())  # the index did not move
        assert run.run("trainer.optimize_step", {"adam_params": ADAM})["result"]["metrics"]["step"] == 2.0


def _slow_events(run, count: int) -> list[str]:
    long = list(range(3, 403))  # 400 tokens x 16 datums per event: long enough to poll while it runs
    payload = fb(tokens=long)
    payload["data"] = payload["data"] * 16
    payload["gradient_accumulation"] = totals(16, 16 * 399)
    return [run.submit("trainer.forward_backward", payload)["event_id"] for _ in range(count)]


def test_a_connection_cut_mid_request_changes_nothing(worker, raw_a, model_id):
    host, port = urlsplit(worker.base_url).hostname, urlsplit(worker.base_url).port
    with Session(raw_a) as session:
        run = initialised(session, model_id)
        # a submit whose body never arrives in full: not admitted, its index unused
        body = msgpack.packb(envelope("trainer.forward", fb(), run.index, run.cuid), use_bin_type=True)
        with socket.create_connection((host, port)) as sock:
            sock.sendall(f"POST /pytrio-actor/v1/events HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer "
                         f"{run.token}\r\nContent-Type: {MSGPACK}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                         + body[:20])
        time.sleep(0.2)
        assert msgpack.unpackb(run.submit_bytes(body).content)["status"] in ("accepted", "running", "succeeded")
        run.index += 1
        # a poll cut while it waits: the events run on, a new poll gets their answers
        ids = _slow_events(run, 3)
        with socket.create_connection((host, port)) as sock:
            sock.sendall(f"GET /pytrio-actor/v1/events/{ids[-1]} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: "
                         f"Bearer {run.token}\r\nPrefer: wait=30\r\n\r\n".encode())
            time.sleep(0.3)
        assert all(run.poll(eid)["status"] == "succeeded" for eid in ids)
        assert run.run("trainer.optimize_step", {"adam_params": ADAM})["result"]["metrics"]["step"] == 1.0


def test_polls_hold_until_the_event_ends(raw_a, model_id):
    with Session(raw_a) as session:
        run = initialised(session, model_id)
        ids = _slow_events(run, 2)
        assert run.poll(ids[-1], wait=30)["status"] == "succeeded"  # one poll: it waited for the end
        assert run.poll(ids[0], wait=0)["status"] == "succeeded"
        missing = raw_a.http.get(f"/pytrio-actor/v1/events/{event_id()}", headers=run.headers(None))
        assert (missing.status_code, missing.json()["code"]) == (404, "event_not_found")


def test_tokens_renew_and_die_with_their_session(raw_a, model_id):
    session = Session(raw_a)
    run = initialised(session, model_id)
    sampler = session.sampling_run()
    renewed = raw_a.control("POST", f"/training-runs/{run.cuid}/renew").json()
    from pytrio.protocol.control.sampling_run.renew import SamplingRunRenewResponse
    from pytrio.protocol.control.service_session.renew import ServiceSessionRenewResponse
    from pytrio.protocol.control.training_run.renew import TrainingRunRenewResponse

    TrainingRunRenewResponse.model_validate(renewed)  # the answers the SDK validates, as it validates them
    ServiceSessionRenewResponse.model_validate(raw_a.control("POST", f"/service-sessions/{session.cuid}/renew").json())
    assert renewed["actor_jwt"]["token"] == run.token
    assert renewed["actor_jwt"]["expires_at"] >= run.created["actor_jwt"]["expires_at"]
    assert renewed["actor"]["endpoint"].endswith("/pytrio-actor")
    again = raw_a.control("POST", f"/sampling-runs/{sampler['sampling_run_cuid']}/renew").json()
    SamplingRunRenewResponse.model_validate(again)
    assert again["actor_jwt"]["token"] == sampler["actor_jwt"]["token"]
    assert raw_a.control("POST", f"/service-sessions/{session.cuid}/close", json={"status": "CANCELLED"}
                         ).status_code == 204
    deadline = time.monotonic() + 10
    while raw_a.control("GET", f"/training-runs/{run.cuid}").status_code != 404 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert raw_a.control("GET", f"/training-runs/{run.cuid}").status_code == 404
    gone = run.submit_bytes(msgpack.packb(envelope("trainer.forward", fb(), run.index, run.cuid)))
    assert (gone.status_code, gone.json()["code"]) == (401, "invalid_token")
    assert raw_a.control("POST", f"/training-runs/{run.cuid}/renew").status_code == 404


def test_per_key_bounds_hold_at_their_limit_and_refuse_one_past(worker, model_id):
    client = RawClient(worker.base_url, KEY_C)
    try:
        sessions = [Session(client) for _ in range(3)]  # --pytrio-max-sessions 3
        refused = client.control("POST", "/service-sessions", json={"sdk_version": "x"})
        assert (refused.status_code, refused.json()["code"]) == (409, "too_many_sessions")
        assert "--pytrio-max-sessions" in refused.json()["message"]
        RawClient(worker.base_url, KEY_B).session()  # another key is not affected
        runs = [sessions[0].training_run() for _ in range(4)]  # --max-training-runs 4
        fifth = client.control("POST", f"/service-sessions/{sessions[0].cuid}/training-runs",
                               json={"base_model": "tiny", "lora_rank": 8})
        assert (fifth.status_code, fifth.json()["code"]) == (409, "too_many_training_runs")
        first, second = sessions[1].sampling_run(), sessions[1].sampling_run()  # --pytrio-max-sampling-runs 2
        for kept in (first, second):
            assert client.control("GET", f"/sampling-runs/{kept['sampling_run_cuid']}").status_code == 200
        third = sessions[1].sampling_run()
        assert client.control("GET", f"/sampling-runs/{first['sampling_run_cuid']}").status_code == 404
        assert client.control("GET", f"/sampling-runs/{third['sampling_run_cuid']}").status_code == 200
        dropped = client.http.post(f"/pytrio-actor/v1/sampling-runs/{first['sampling_run_cuid']}/sample",
                                   headers={"Authorization": f"Bearer {first['actor_jwt']['token']}"}, json={})
        assert dropped.status_code == 401
        bad_page = client.control("GET", "/checkpoints", params={"limit": 1001})
        assert bad_page.status_code == 400 and bad_page.json()["field"] == "limit"
        assert runs and all(client.control("GET", f"/training-runs/{r.cuid}").status_code == 200 for r in runs)
        for session in sessions:
            session.__exit__()
    finally:
        client.close()


def _sample(client: RawClient, sampler: dict, body: dict, stream: bool = False):
    headers = {"Authorization": f"Bearer {sampler['actor_jwt']['token']}", "Accept": "application/json"}
    path = f"/pytrio-actor/v1/sampling-runs/{sampler['sampling_run_cuid']}/sample"
    if stream:
        return client.http.stream("POST", path, headers=headers, json=body)
    return client.http.post(path, headers=headers, json=body)


def test_samples_are_checked_deduplicated_and_kept_alive(raw_a):
    with Session(raw_a) as session:
        sampler = session.sampling_run()
        prompt = {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]}
        for params, field, status in [({"max_tokens": 0}, "sampling_params.max_tokens", 400),
                                      ({"max_tokens": 4, "top_k": 0}, "sampling_params.top_k", 400),
                                      ({"max_tokens": 4, "min_p": 0.1}, "sampling_params.min_p", 400),
                                      ({"max_tokens": 4, "stop": ["x"] * 65}, "sampling_params.stop", 400),
                                      ({"max_tokens": 100_000}, "sampling_params.max_tokens", 413)]:
            response = _sample(raw_a, sampler, {"request_id": "req_1", "prompt": prompt, "sampling_params": params})
            assert response.status_code == status and response.json()["field"] == field, response.text
        image = {"chunks": [{"type": "image", "data": "iVBORw0KGgo=", "format": "png"}]}
        refused = _sample(raw_a, sampler, {"request_id": "req_2", "prompt": image,
                                           "sampling_params": {"max_tokens": 2}})
        assert (refused.status_code, refused.json()["code"]) == (400, "unsupported_input")
        body = {"request_id": "req_same", "prompt": prompt, "num_samples": 3,
                "sampling_params": {"max_tokens": 48, "stop_token_ids": []}}  # unseeded, 48 tokens: > the keep-alive
        with _sample(raw_a, sampler, body, stream=True) as response:
            assert response.status_code == 200
            raw = b"".join(response.iter_bytes())
        assert raw.startswith(b" \n")  # whitespace first: the answer took longer than --pytrio-sample-keepalive
        first = json.loads(raw)
        assert [len(s["tokens"]) for s in first["sequences"]] == [48, 48, 48]
        again = _sample(raw_a, sampler, body).content
        assert json.loads(again)["sequences"] == first["sequences"]  # the retry gets the same sample
        other = json.loads(_sample(raw_a, sampler, {**body, "request_id": "req_other"}).content)
        assert other["sequences"] != first["sequences"]


def test_download_urls_are_signed_and_expire(worker, raw_a, model_id):
    with Session(raw_a) as session:
        run = initialised(session, model_id)
        saved = run.run("trainer.save_state", {"name": "to-download"})["result"]["checkpoint"]
        link = raw_a.control("GET", f"/checkpoints/{saved['checkpoint_cuid']}/download-url").json()
        assert link["tls_cert_pem"] is None and link["source"] == "actor"
        with httpx.Client(timeout=10) as anonymous:  # no credentials at all, as the SDK fetches it
            assert anonymous.get(link["url"]).status_code == 200
            token = link["url"].split("/downloads/")[1].split("/")[0]
            payload, signature = token.split(".")
            tampered = link["url"].replace(token, f"{payload}.{signature[::-1]}")
            raw = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            raw[3] += 3600  # a later expiry, signed by nobody
            longer = base64.urlsafe_b64encode(json.dumps(raw, separators=(",", ":")).encode()).decode().rstrip("=")
            extended = link["url"].replace(token, f"{longer}.{signature}")
            for url in (tampered, extended):
                assert anonymous.get(url).status_code == 403, url
        other = raw_a.control("GET", f"/checkpoints/{'0' * 16}/download-url")
        assert other.status_code == 404
        assert raw_a.control("DELETE", f"/checkpoints/{saved['checkpoint_cuid']}").status_code == 204
        with httpx.Client(timeout=10) as anonymous:
            assert anonymous.get(link["url"]).status_code == 404  # deleted: the old URL opens nothing


def test_concurrent_hostile_traffic_leaves_the_worker_serving(worker, raw_a, model_id):
    errors = []

    def hammer() -> None:
        client = RawClient(worker.base_url, KEY_A)
        try:
            for body in (b"\x91" * 40, b"\xdd\xff\xff\xff\xff", b"\xc1", b"garbage" * 100):
                response = client.http.post("/pytrio-actor/v1/events", content=body,
                                             headers={"Authorization": "Bearer pta_nope", "Content-Type": MSGPACK})
                if response.status_code != 401:
                    errors.append(response.status_code)
        finally:
            client.close()

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with Session(raw_a) as session:
        assert initialised(session, model_id).run("trainer.forward", fb())["status"] == "succeeded"
