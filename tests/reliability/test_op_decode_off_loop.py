"""A training op's tensors are decoded (base64 to arrays, checked), its body parsed and hashed, in a
worker thread, never on the event loop that answers every client: a large forward_backward being
decoded must not stall other requests. Ordering and idempotency stay as they were: an op sent while
the one before it is still being decoded waits for it and is accepted after it, a resent op gets the
original request back and a different op under a used seq_id gets 409.

The worker runs in this process (real uvicorn, real HTTP) so that the decoding can be watched and
held: while the test holds a decode, ``/v1/health`` must answer at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from pytrio_compat.types.tensor import WireTensor
from server_mock.api import bodies
from server_mock.api.native import runs
from server_mock.api.tinker.proto import decode as tinker_decode

from .reliability_helpers import in_process_worker, on_event_loop

HOLD_SECONDS = 10.0  # a held decode gives up after this long (so the old, on-loop code fails, not hangs)


class Watch:
    """Records where tensors were decoded and bodies parsed; can hold the next decode until released."""

    def __init__(self) -> None:
        self.decodes: list[bool] = []  # on the event loop?
        self.parses: list[tuple[int, bool]] = []  # (body bytes, on the event loop?)
        self.armed = False
        self.holding = threading.Event()
        self.release = threading.Event()

    def decode(self, original, *args):
        self.decodes.append(on_event_loop())
        if self.armed:
            self.armed = False
            self.holding.set()
            self.release.wait(HOLD_SECONDS)
        return original(*args)

    def parse(self, original, model, raw, *rest):
        self.parses.append((len(raw), on_event_loop()))
        return original(model, raw, *rest)


@pytest.fixture()
def watched_worker(tiny_model_dir, tmp_path, monkeypatch):
    watch = Watch()
    decode, parse, proto_decode = runs.wire_array, bodies.parse_body, tinker_decode._array_from_bytes
    monkeypatch.setattr(runs, "wire_array", lambda t, f: watch.decode(decode, t, f))  # native: base64 tensors
    monkeypatch.setattr(tinker_decode, "_array_from_bytes",  # Tinker: protobuf tensors
                        lambda raw, dtype, where: watch.decode(proto_decode, raw, dtype, where))
    monkeypatch.setattr(bodies, "parse_body", lambda m, r, *rest: watch.parse(parse, m, r, *rest))
    with in_process_worker(tiny_model_dir, tmp_path / "storage") as base:
        try:
            yield base, watch
        finally:
            watch.release.set()  # a decode still held must not keep the server from stopping


def _big_forward(datums: int = 64, n: int = 1000) -> dict:
    """A forward op of ``datums`` x ``n`` tokens: a JSON body of about 1.4 MB."""
    data = []
    for d in range(datums):
        ids = (np.arange(n + 1, dtype=np.int64) * 7 + d) % 500 + 5
        data.append({"tokens": WireTensor.from_array(ids[:-1]).model_dump(),
                     "loss_fn_inputs": {"target_tokens": WireTensor.from_array(ids[1:]).model_dump()}})
    return {"op": "forward", "loss_fn": "cross_entropy", "data": data}


def _health_seconds(http: httpx.Client) -> float:
    start = time.monotonic()
    assert http.get("/v1/health", timeout=HOLD_SECONDS * 2).status_code == 200
    return time.monotonic() - start


def test_native_op_is_decoded_off_the_loop_in_order(watched_worker):
    base, watch = watched_worker
    with httpx.Client(base_url=base, timeout=120) as http, ThreadPoolExecutor(2) as pool:
        run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).json()["training_run_id"]
        ops = f"/v1/training_runs/{run}/ops"
        big = {"seq_id": 1, "payload": _big_forward()}
        watch.armed = True
        first = pool.submit(http.post, ops, json=big)
        assert watch.holding.wait(60), "the op was never decoded"
        held_health = _health_seconds(http)
        # the next op arrives while the first is being decoded: it waits for it, then is accepted after it
        second = pool.submit(http.post, ops, json={"seq_id": 2, "payload": {
            "op": "optim_step", "adam_params": {"learning_rate": 1e-3}}})
        time.sleep(0.3)
        second_waited = not second.done()
        watch.release.set()
        accepted = [first.result().json(), second.result().json()]
        assert held_health < 1.0, f"/v1/health took {held_health:.2f}s while an op was being decoded"
        assert second_waited and all("request_id" in a and not a["duplicate"] for a in accepted), accepted
        results = [http.get(f"/v1/requests/{a['request_id']}", params={"wait": 60}).json() for a in accepted]
        assert [r["status"] for r in results] == ["succeeded", "succeeded"], results
        assert len(results[0]["result"]["loss_fn_outputs"]) == 64
        # idempotency: the same op again is the same request; another op under seq_id 1 is a conflict
        again = http.post(ops, json=big).json()
        assert again == {"request_id": accepted[0]["request_id"], "duplicate": True}, again
        other = dict(big, payload=_big_forward(datums=2))
        clash = http.post(ops, json=other)
        assert clash.status_code == 409 and clash.json()["error"]["code"] == "seq_id_conflict", clash.text
        # an invalid op is refused with its field named, and uses up nothing
        bad = _big_forward(datums=2)
        bad["data"][1]["tokens"] = WireTensor.from_array(np.asarray([5, 9999], dtype=np.int64)).model_dump()
        refused = http.post(ops, json={"seq_id": 3, "payload": bad})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "data[1].tokens", refused.text
        assert http.get(f"/v1/training_runs/{run}").json()["last_seq_id"] == 2
    assert len(watch.decodes) >= 64 * 2 and not any(watch.decodes), "tensors were decoded on the event loop"
    big_parses = [on_loop for size, on_loop in watch.parses if size > bodies.BIG_BODY_BYTES]
    assert len(big_parses) == 2 and not any(big_parses), watch.parses


def _tinker_fwd_body(model_id: str, seq_id: int, datums: int = 16, n: int = 1000) -> bytes:
    data = []
    for d in range(datums):
        ids = [(7 * i + d) % 500 + 5 for i in range(n + 1)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:]}))
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    return message.SerializeToString()


def _tinker_result(http: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(100):
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if "protobuf" in r.headers["content-type"] or r.json().get("type") != "try_again":
            return r
    raise AssertionError(f"future {request_id} never finished")


def test_tinker_forward_backward_is_decoded_off_the_loop(watched_worker):
    base, watch = watched_worker
    with httpx.Client(base_url=base, timeout=120) as http, ThreadPoolExecutor(1) as pool:
        session = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        created = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                          "base_model": "tiny", "lora_config": {"rank": 4}}).json()
        assert _tinker_result(http, created["request_id"]).json()["model_id"] == created["model_id"]
        watch.decodes.clear()
        watch.armed = True
        sent = pool.submit(http.post, "/api/v1/forward_backward", content=_tinker_fwd_body(created["model_id"], 1),
                           headers={"Content-Type": "application/x-protobuf"})
        assert watch.holding.wait(60), "the op was never decoded"
        held_health = _health_seconds(http)
        watch.release.set()
        answer = sent.result()
        assert held_health < 1.0, f"/v1/health took {held_health:.2f}s while an op was being decoded"
        assert answer.status_code == 200, answer.text
        result = _tinker_result(http, answer.json()["request_id"])
        assert "protobuf" in result.headers["content-type"], result.text
    assert len(watch.decodes) >= 16 * 2 and not any(watch.decodes), "tensors were decoded on the event loop"
