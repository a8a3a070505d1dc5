"""Fuzzed protobuf bodies on the Tinker ``forward_backward`` route of a real worker.

Random and mutated ForwardBackwardRequests (built with the official client's protobuf module):
random tensors (dense, sparse, bad dtypes, huge or negative shapes), truncated bodies, flipped and
inserted bytes, fields with the wrong wire type, huge declared lengths, plain garbage. None may get a
5xx (or the 422 ``internal_error`` the Tinker side answers for one), none may change any tenant's
weights or Adam state (checkpoint fingerprints before and after), and a well-formed request on another
model keeps answering, with the same numbers, while it runs.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import statistics
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb
from tinker_raw_client import RawTinker, logprobs

KEY_A, KEY_B = "tml-fuzz-a", "tml-fuzz-b"
EXAMPLES = 400
JSON_EXAMPLES = 500
PROBE_EVERY = 10
LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "bogus", ""]
INPUT_KEYS = ["target_tokens", "logprobs", "advantages", "weights", "mask"]


@pytest.fixture(scope="module")
def tinker_worker(worker_factory):
    return worker_factory("--max-body-bytes", "1000000", "--max-tokens-per-request", "4096",
                          api_keys=[KEY_A[4:], KEY_B[4:]])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


_WIRE_PAYLOAD = {0: b"\x96\x01", 1: b"\x00" * 8, 2: b"\x03abc", 5: b"\x00" * 4, 3: b"", 4: b"", 6: b"", 7: b""}
_EXPECTED_WIRE = {1: 2, 2: 0, 3: 2, 4: 2, 5: 2, 6: 0, 7: 2}


@st.composite
def _tensor(draw, tensor: pb.Tensor) -> None:
    tensor.dtype = draw(st.integers(0, 6))  # 0, 5 and 6 are not valid dtypes
    huge = st.sampled_from([2**31, 2**40, 2**62, 2 * 10**10])
    tensor.shape.extend(draw(st.lists(st.one_of(st.integers(-2, 12), huge), max_size=3)))
    kind = draw(st.sampled_from(["dense", "dense", "sparse", "none"]))
    if kind == "dense":
        tensor.dense = draw(st.binary(max_size=96))
    elif kind == "sparse":
        ints = st.lists(st.integers(-3, 20), max_size=6)
        tensor.sparse_csr.values = draw(st.binary(max_size=32))
        tensor.sparse_csr.crow_indices = np.asarray(draw(ints), "<i8").tobytes()
        tensor.sparse_csr.col_indices = np.asarray(draw(ints), "<i8").tobytes()


@st.composite
def _message(draw, model_ids: list[str]) -> bytes:
    # seq_ids that are stale, refused as too far ahead, or anything at all (a mutation may land anywhere)
    seq = draw(st.one_of(st.sampled_from([-3, 0, 1, 2, 3]), st.integers(2000, 2**31 - 1)))
    message = pb.ForwardBackwardRequest(model_id=draw(st.sampled_from(model_ids)), seq_id=seq,
                                        loss_fn=draw(st.sampled_from(LOSSES)), forward_only=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        datum = message.data.add()
        for _ in range(draw(st.integers(0, 2))):
            tokens = draw(st.lists(st.integers(-2**31, 2**31 - 1), max_size=10))
            datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
        if draw(st.integers(0, 9)) == 0:
            datum.model_input.add().image.data = b"\x89PNG"
        for key in draw(st.lists(st.sampled_from(INPUT_KEYS), unique=True, max_size=4)):
            draw(_tensor(datum.loss_fn_inputs[key]))
    for key in draw(st.lists(st.sampled_from(["clip_low_threshold", "beta", "loss_id"]), unique=True, max_size=2)):
        if draw(st.booleans()):
            message.loss_fn_config_v2[key].text = draw(st.text(max_size=8))
        else:
            message.loss_fn_config[key] = draw(st.floats(allow_nan=True, allow_infinity=True))
    return message.SerializeToString()


@st.composite
def _body(draw, model_ids: list[str]) -> bytes:
    raw = draw(_message(model_ids))
    mutation = draw(st.sampled_from(["none", "truncate", "flip", "splice", "wrong_wire", "huge_length", "garbage"]))
    if mutation == "truncate" and raw:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif mutation == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    elif mutation == "splice":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.binary(min_size=1, max_size=16)) + raw[i:]
    elif mutation == "wrong_wire":
        number = draw(st.integers(1, 9))
        wire = draw(st.sampled_from([w for w in range(8) if w != _EXPECTED_WIRE.get(number)]))
        extra = _varint(number << 3 | wire) + _WIRE_PAYLOAD[wire]
        raw = extra + raw if draw(st.booleans()) else raw + extra
    elif mutation == "huge_length":
        raw += _varint(3 << 3 | 2) + _varint(draw(st.sampled_from([2**31, 2**40, 2**63]))) + b"xy"
    elif mutation == "garbage":
        raw = draw(st.binary(max_size=64))
    return raw


def _fingerprint(raw: RawTinker, storage, model_id: str, seq: int, name: str) -> dict[str, bytes]:
    from server_mock.storage.checkpoints import CheckpointStore, parse_path

    r = raw.post("/save_weights", json={"model_id": model_id, "seq_id": seq, "path": name, "type": "save_weights"})
    assert r.status_code == 200, r.text
    out = raw.result(r.json()["request_id"])
    if "error" in out and "this model is at seq_id" in out["error"]:  # a fuzzed request ran in order
        at = int(out["error"].rsplit("this model is at seq_id ", 1)[1].split(")")[0])
        return _fingerprint(raw, storage, model_id, at, name)
    assert "path" in out, out
    trio = out["path"].replace("tinker://", "trio://").replace("/weights/", "/state/")
    return CheckpointStore(storage).fingerprint(parse_path(trio))


@pytest.mark.timeout(900)
def test_fuzzed_protobuf_bodies_never_crash_or_change_weights(tinker_worker):
    a, b = RawTinker(tinker_worker.base_url, KEY_A), RawTinker(tinker_worker.base_url, KEY_B)
    storage = tinker_worker.storage
    victim, control, probe = a.model("tiny", seed=11), b.model("tiny", seed=11), a.model("tiny", seed=12)
    for raw, model in ((a, victim), (b, control)):  # trained a little: weights and Adam state are not zero
        raw.run_forward(model, 1)
        assert raw.optim_step(model, 2).status_code == 200
    before = {m: _fingerprint(r, storage, m, 3, "before") for r, m in ((a, victim), (b, control))}
    baseline = logprobs(a.run_forward(probe, 1, forward_only=True))
    seen: set[str] = set()
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    probe_seq = [2]

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=_body([victim, victim, control, "sess-nope:train:0", ""]))
    def attack(body: bytes) -> None:
        seen.add(hashlib.sha256(body).hexdigest())
        r = a.forward_backward(victim, 0, body=body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            answer = r.json()
            assert answer["code"] != "internal_error" and answer["detail"], answer
        if len(seen) % PROBE_EVERY == 0:
            start = time.monotonic()
            out = a.run_forward(probe, probe_seq[0], forward_only=True)
            latencies.append(time.monotonic() - start)
            probe_seq[0] += 1
            np.testing.assert_array_equal(logprobs(out), baseline)

    attack()
    after = {victim: _fingerprint(a, storage, victim, 4, "after"), control: _fingerprint(b, storage, control, 4,
                                                                                        "after")}
    assert after == before
    log = (storage.parent / "worker.log").read_text()
    log = log[log.rfind("Started server process"):] if "Started server process" in log else log  # this worker's
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]
    print(f"\nfuzz: {len(seen)} distinct bodies, statuses {sorted(statuses.items())}; well-formed forward "
          f"during the attack: median {statistics.median(latencies) * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms over {len(latencies)} probes")
    assert len(seen) > EXAMPLES // 2 and max(latencies) < 5.0
    a.close()
    b.close()


JSON_ROUTES = {  # route -> the fields its handler reads
    "/create_session": ["tags", "user_metadata"],
    "/session_heartbeat": ["session_id"],
    "/create_model": ["session_id", "model_seq_id", "base_model", "lora_config", "optimizer_config"],
    "/get_info": ["model_id"],
    "/optim_step": ["model_id", "seq_id", "adam_params", "optim_params", "optimizer_params"],
    "/save_weights": ["model_id", "seq_id", "path", "ttl_seconds", "overwrite"],
    "/save_weights_for_sampler": ["model_id", "seq_id", "path", "ttl_seconds"],
    "/load_weights": ["model_id", "seq_id", "path", "optimizer", "session_id", "model_seq_id", "base_model"],
    "/weights_info": ["tinker_path"],
    "/create_sampling_session": ["session_id", "sampling_session_seq_id", "base_model", "model_path"],
    "/asample": ["sampling_session_id", "seq_id", "base_model", "model_path", "prompt", "num_samples",
                 "sampling_params", "prompt_logprobs", "prompt_logprobs_last_n", "topk_prompt_logprobs"],
    "/retrieve_future": ["request_id", "allow_metadata_only"],
}
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 5),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                     st.sampled_from(["tiny", "tinker://run-x/weights/a", "tinker://../../etc/passwd",
                                      "cross_entropy"]))


def _json_value(known: list[str]):
    """Any JSON value: as often a list or an object as a scalar (wrong types are the point)."""
    scalars = st.one_of(_SCALARS, st.sampled_from(known))
    keys = st.sampled_from(["type", "tokens", "chunks", "max_tokens", "stop", "seed", "rank", "learning_rate",
                            "temperature", "top_k", "top_p", "beta1", "eps"])
    nested = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
    return st.one_of(scalars, st.lists(nested, max_size=3), st.dictionaries(keys, nested, max_size=3))


def _long_list(data) -> object:
    """Up to 200000 items of one wrong type, bare or where a list of token ids or chunks is read."""
    item = data.draw(st.sampled_from(["a", [], {}, None, True, 2**70, 1.5, [[]]]))
    items = [item] * data.draw(st.sampled_from([1000, 50_000, 200_000]))
    return data.draw(st.sampled_from([items, {"chunks": items}, {"chunks": [{"tokens": items}]}, {"stop": items}]))


@pytest.mark.timeout(600)
def test_fuzzed_json_bodies_never_crash(tinker_worker):
    a = RawTinker(tinker_worker.base_url, KEY_A, timeout=30)
    session = a.session()
    model = a.model("tiny", seed=21)
    sampler = a.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                       "base_model": "tiny"}).json()["sampling_session_id"]
    known = [session, model, sampler, "tk-nope"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    templates = {  # well-formed bodies; each example drops or replaces a few of their fields
        "/create_session": {"tags": [], "type": "create_session"},
        "/session_heartbeat": {"session_id": session},
        "/create_model": {"session_id": session, "model_seq_id": 1, "base_model": "tiny", "lora_config": {"rank": 4}},
        "/get_info": {"model_id": model},
        "/optim_step": {"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
        "/save_weights": {"model_id": model, "seq_id": 1, "path": "fuzz"},
        "/save_weights_for_sampler": {"model_id": model, "seq_id": 1, "path": "fuzz"},
        "/load_weights": {"model_id": model, "seq_id": 1, "path": "tinker://run-x/weights/a"},
        "/weights_info": {"tinker_path": "tinker://run-x/weights/a"},
        "/create_sampling_session": {"session_id": session, "sampling_session_seq_id": 1, "base_model": "tiny"},
        "/asample": {"sampling_session_id": sampler, "prompt": prompt, "num_samples": 1,
                     "sampling_params": {"max_tokens": 2}},
        "/retrieve_future": {"request_id": "tk-nope"},
    }
    seen: set[str] = set()
    futures: list[str] = []

    @settings(max_examples=JSON_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(route=st.sampled_from(sorted(JSON_ROUTES)), data=st.data())
    def attack(route: str, data) -> None:
        body = dict(templates[route])
        for name in data.draw(st.lists(st.sampled_from(JSON_ROUTES[route]), unique=True, min_size=1, max_size=3)):
            if data.draw(st.integers(0, 3)) == 0:
                body.pop(name, None)
            else:
                body[name] = data.draw(_json_value(known))
        if data.draw(st.integers(0, 19)) == 0:
            body = data.draw(_json_value(known))
        if isinstance(body, dict) and data.draw(st.integers(0, 9)) == 0:  # wrongly typed items in a long list
            body[data.draw(st.sampled_from(JSON_ROUTES[route] + ["prompt"]))] = _long_list(data)
        raw = json.dumps(body).encode()
        seen.add(hashlib.sha256(route.encode() + raw).hexdigest())
        r = a.post(route, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (route, body, r.text)
        if r.status_code >= 400:
            assert r.json()["code"] != "internal_error", (route, body, r.text)
        elif isinstance(r.json(), dict) and "request_id" in r.json() and route != "/retrieve_future":
            futures.append(r.json()["request_id"])

    attack()

    def outcome(request_id: str) -> str:
        """Every future answers within the long poll (30 s): a final answer, or try_again for one still waiting
        for an earlier seq_id. A hang is a timeout here, and fails the test."""
        r = a.http.post(a.base + "/retrieve_future", json={"request_id": request_id}, timeout=45)
        assert r.status_code == 200, r.text
        out = r.json() if "json" in r.headers.get("content-type", "") else {}
        if out.get("type") == "try_again":
            return "waiting"
        return "server failure" if out.get("category") == "server" else "final"

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(outcome, futures))
    assert "server failure" not in outcomes, [f for f, o in zip(futures, outcomes) if o == "server failure"][:3]
    assert outcomes.count("final") >= 1, outcomes  # the check above saw futures that finished
    log = (tinker_worker.storage.parent / "worker.log").read_text()
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]
    assert httpx.get(tinker_worker.base_url + "/api/v1/healthz").status_code == 200
    print(f"\njson fuzz: {len(seen)} distinct bodies, {len(futures)} futures: {outcomes.count('final')} final, "
          f"{outcomes.count('waiting')} waiting for an earlier seq_id")
    a.close()
