"""Abuse of the Tinker protocol against a real worker: far-ahead seq_ids, sparse-tensor bombs, memory
held by out-of-order requests, sampler churn, and server paths in get_info.

The worker runs with small limits so the bounds are reached with small bodies: max_body_bytes=1e6
(so out-of-order requests may hold 4e6 bytes per session and 16e6 on the worker) and
max_tokens_per_request=4096 (so a forward_backward request may declare 8 x 4096 tensor elements).
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb
from tinker_raw_client import RawTinker, fwd_body, fwd_message, logprobs

KEY_A, KEY_B = "tml-key-a", "tml-key-b"
MAX_BODY = 1_000_000
MAX_SEQ_AHEAD = 1024


@pytest.fixture(scope="module")
def tinker_worker(worker_factory):
    return worker_factory("--max-body-bytes", str(MAX_BODY), "--max-tokens-per-request", "4096", "--max-samplers",
                          "4", api_keys=[KEY_A[4:], KEY_B[4:]])


@pytest.fixture()
def raw_a(tinker_worker):
    client = RawTinker(tinker_worker.base_url, KEY_A)
    yield client
    client.close()


@pytest.fixture()
def raw_b(tinker_worker):
    client = RawTinker(tinker_worker.base_url, KEY_B)
    yield client
    client.close()


def _train_and_probe(raw: RawTinker, model_id: str) -> list[np.ndarray]:
    """forward_backward, optim_step, forward: the logprobs before and after the step."""
    first = raw.run_forward(model_id, 1)
    step = raw.optim_step(model_id, 2)
    assert step.status_code == 200, step.text
    assert raw.result(step.json()["request_id"])["metrics"]["grad_norm:mean"] > 0
    second = raw.run_forward(model_id, 3, forward_only=True)
    return [logprobs(first), logprobs(second)]


@pytest.mark.timeout(180)
def test_far_ahead_seq_id_is_refused_and_others_are_unaffected(tinker_worker, raw_a, raw_b):
    victim = raw_a.model("tiny", seed=3)
    control = raw_b.model("tiny", seed=5)
    expected = _train_and_probe(raw_b, control)  # the same work with nobody attacking

    for seq in (1 + MAX_SEQ_AHEAD, 2**31 - 1, 10**30):
        for r in (raw_a.optim_step(victim, seq),
                  raw_a.forward_backward(victim, seq, body=fwd_body(victim, seq)) if seq < 2**31 else None):
            if r is None:
                continue
            assert r.status_code == 400, r.text
            detail = r.json()["detail"]
            assert r.json()["field"] == "seq_id" and f"max_seq_ahead={MAX_SEQ_AHEAD}" in detail, detail
            assert "next expected seq_id of this model is 1" in detail, detail
    boundary = raw_a.model("tiny", seed=4)  # the farthest seq_id allowed is held, not refused
    assert raw_a.optim_step(boundary, MAX_SEQ_AHEAD).status_code == 200

    stop, refused, errors = threading.Event(), [0], []

    def attack() -> None:
        with httpx.Client(headers={"X-API-Key": KEY_A}, timeout=30) as http:
            seq = 2**31 - 1
            while not stop.is_set():
                r = http.post(f"{tinker_worker.base_url}/api/v1/optim_step",
                              json={"model_id": victim, "seq_id": seq, "adam_params": {"learning_rate": 1.0}})
                if r.status_code != 400:
                    errors.append(r.text)
                refused[0] += 1
                seq -= 7919

    threads = [threading.Thread(target=attack) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        latencies = []
        for path in ("/api/v1/healthz", "/v1/health") * 5:
            start = time.monotonic()
            assert httpx.get(tinker_worker.base_url + path, timeout=5).status_code == 200
            latencies.append(time.monotonic() - start)
        other = raw_b.model("tiny", seed=5)
        got = _train_and_probe(raw_b, other)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    print(f"\nfar-ahead seq_id: {refused[0]} refused; health during the attack: max {max(latencies) * 1000:.0f} ms")
    assert refused[0] > 10 and max(latencies) < 1.0, (refused[0], latencies)
    for mine, theirs in zip(got, expected):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(logprobs(raw_a.run_forward(victim, 1)).shape, expected[0].shape)


def test_gap_skipping_is_constant_time():
    """A gap of a billion seq_ids is skipped at once, remembered as one range, not one entry each."""
    import asyncio

    from server_mock.api.tinker.gate import SeqGate

    async def scenario():
        gate = SeqGate(gap_wait=0.05, max_ahead=2**40)
        handed, futures = [], {}

        def submit(seq):
            handed.append(seq)

            async def work():
                return seq

            return work()

        def add(work):
            futures[len(futures)] = asyncio.ensure_future(work)
            return str(len(futures) - 1)

        far = 10**9
        gate.admit(far, "d", lambda: submit(far), add, str)
        start = time.monotonic()
        await asyncio.sleep(0.3)
        assert handed == [far] and gate.next == far + 1
        assert len(gate._admitted) == 1 and list(gate._skipped) == [(1, far)]
        assert "arrived after" in gate.admit(12345, "d", lambda: submit(12345), add, lambda m: m)
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 1.0


def _sparse_body(model_id: str, seq: int, shape, crow, col, values, dense: bool = False) -> bytes:
    message = fwd_message(model_id, seq)
    tensor = message.data[0].loss_fn_inputs["weights"]
    tensor.dtype = pb.DTYPE_FLOAT32
    tensor.shape.extend(shape)
    if dense:
        tensor.dense = np.asarray(values, "<f4").tobytes()
    else:
        tensor.sparse_csr.values = np.asarray(values, "<f4").tobytes()
        tensor.sparse_csr.crow_indices = np.asarray(crow, "<i8").tobytes()
        tensor.sparse_csr.col_indices = np.asarray(col, "<i8").tobytes()
    return message.SerializeToString()


@pytest.mark.timeout(120)
def test_sparse_tensor_bombs_are_refused_before_allocating(tinker_worker, raw_a):
    model = raw_a.model("tiny", seed=7)
    where = "data[0].loss_fn_inputs.weights"
    cases = [  # (shape, crow, col, values, dense), status, field, words in the message
        (([1, 2 * 10**10], [0, 0], [], [], False), 413, f"{where}.shape", "max_tokens_per_request=4096"),
        (([2**40, 2**40], [0], [], [], False), 413, f"{where}.shape", "32768"),
        (([2, 3], [0, 2, 1], [0, 1], [1.0, 2.0], False), 400, f"{where}.sparse_csr.crow_indices", "going down"),
        (([2, 3], [0, 1], [0], [1.0], False), 400, f"{where}.sparse_csr.crow_indices", "rows + 1"),
        (([1, 3], [0, 1], [5], [1.0], False), 400, f"{where}.sparse_csr.col_indices", "[0, 3)"),
        (([1, 3], [0, 1], [-1], [1.0], False), 400, f"{where}.sparse_csr.col_indices", "[0, 3)"),
        (([1, 3], [0, 2], [0], [1.0, 2.0], False), 400, f"{where}.sparse_csr.col_indices", "2 values"),
        (([-1, 3], [0], [], [], False), 400, f"{where}.shape", "negative"),
        (([2, 2, 2], [0], [], [], False), 400, f"{where}.shape", "2-D"),
        (([3, 4], None, None, [1.0] * 5, True), 400, f"{where}.shape", "5 values"),
    ]
    seq = 1
    for (shape, crow, col, values, dense), status, field, words in cases:
        body = _sparse_body(model, seq, shape, crow, col, values, dense)
        start = time.monotonic()
        r = raw_a.forward_backward(model, seq, body=body)
        assert r.status_code == status, (shape, r.text)
        assert r.json()["field"] == field and words in r.json()["detail"], r.json()
        assert time.monotonic() - start < 2.0
        seq += 1  # a refused request used up its seq_id: the next one runs at once
    assert len(_sparse_body(model, 1, [1, 2 * 10**10], [0, 0], [], [])) < 200
    start = time.monotonic()
    out = raw_a.run_forward(model, seq, forward_only=True)
    assert time.monotonic() - start < 10 and np.isfinite(logprobs(out)).all()
    # the well-formed sparse form (as the SDK sends 2-D weights) still decodes; here its shape is wrong for
    # the loss, so the service refuses it after decoding, naming the field
    good = _sparse_body(model, seq + 1, [5, 2], [0, 1, 1, 2, 2, 2], [1, 0], [2.0, 1.5])
    r = raw_a.forward_backward(model, seq + 1, body=good)
    assert r.status_code == 200, r.text
    assert "weights" in raw_a.result(r.json()["request_id"])["error"]


def _heavy_body(model_id: str, seq: int, n_tokens: int = 4096, n_elements: int = 32768) -> bytes:
    """A forward_backward as large as the limits allow: 4096 tokens and a 32768-element int64 input
    (~280 kB on the wire)."""
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.zeros(n_tokens, "<i4").tobytes()
    tensor = datum.loss_fn_inputs["target_tokens"]
    tensor.dtype, tensor.dense = pb.DTYPE_INT64, np.zeros(n_elements, "<i8").tobytes()
    return message.SerializeToString()


@pytest.mark.timeout(180)
def test_bytes_held_by_out_of_order_requests_are_bounded(raw_a):
    """A waiting request holds its body (the smaller form); 4 bodies' worth per session, 16 per worker."""
    models = [raw_a.model("tiny", seed=i) for i in range(5)]
    size = len(_heavy_body(models[0], 2))
    per_session, per_worker = (4 * MAX_BODY) // size, (16 * MAX_BODY) // size
    assert per_session < per_worker <= per_session + 4 * (per_session - 1)  # five models are enough

    def hold(model: str, seqs) -> list[httpx.Response]:
        return [raw_a.forward_backward(model, s, body=_heavy_body(model, s)) for s in seqs]

    held = hold(models[0], range(2, 2 + per_session))  # all wait for seq_id 1
    assert all(r.status_code == 200 for r in held), [r.text for r in held if r.status_code != 200]
    second = hold(models[0], [2 + per_session])[0]
    assert second.status_code == 429 and second.headers["retry-after"] == "1", second.text
    assert f"max_waiting_bytes_per_session={4 * MAX_BODY}" in second.json()["detail"]
    left, seq = per_worker - per_session, {}
    for model in models[1:]:  # fill the worker
        count = min(per_session - 1, left)
        assert all(r.status_code == 200 for r in hold(model, range(2, 2 + count)))
        left, seq[model] = left - count, 2 + count
    assert left == 0
    over = hold(models[4], [seq[models[4]]])[0]  # room in its session, none on the worker
    assert over.status_code == 429 and f"max_waiting_bytes_per_worker={16 * MAX_BODY}" in over.json()["detail"]
    # a request the limits would refuse anyway is refused at once, never held
    late = seq[models[4]]
    r = raw_a.forward_backward(models[4], late, body=_heavy_body(models[4], late, n_tokens=4097))
    assert r.status_code == 413 and "max_tokens_per_request=4096" in r.json()["detail"], r.text
    r = raw_a.forward_backward(models[4], late + 1, body=_heavy_body(models[4], late + 1, n_elements=32769))
    assert r.status_code == 413 and "data[0].loss_fn_inputs.target_tokens" == r.json()["field"], r.text
    # seq_id 1 arrives: the held requests are decoded again and run (and fail in the service: 4096 tokens
    # is over the tiny model's context), and what they held is given back
    raw_a.run_forward(models[0], 1)
    failed = raw_a.result(held[-1].json()["request_id"])
    assert failed["error"].startswith("data[0].tokens") and failed["category"] == "user", failed
    assert hold(models[4], [late + 2])[0].status_code == 200
    for model in models[1:]:  # finishing a session fails its waiting requests and frees their bytes
        session = model.split(":train:")[0]
        assert raw_a.post(f"/sessions/{session}/finish", json={}).status_code == 200
    after = 3 + per_session  # models[0] is at seq_id 2 + per_session now; these wait behind it
    assert all(r.status_code == 200 for r in hold(models[0], range(after, after + per_session)))


@pytest.mark.timeout(120)
def test_asample_without_a_session_reuses_one_sampler(raw_a):
    session = raw_a.session()
    own = raw_a.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                       "base_model": "tiny"}).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]}
    params = {"max_tokens": 2, "seed": 1, "temperature": 1.0}
    for _ in range(8):  # the worker keeps 4 samplers per key: a sampler per request would evict `own`
        r = raw_a.post("/asample", json={"base_model": "tiny", "prompt": prompt, "num_samples": 1,
                                         "sampling_params": params})
        assert r.status_code == 200, r.text
        assert isinstance(raw_a.result(r.json()["request_id"]), bytes)
    r = raw_a.post("/asample", json={"sampling_session_id": own, "seq_id": 0, "prompt": prompt, "num_samples": 1,
                                     "sampling_params": params})
    out = raw_a.result(r.json()["request_id"])
    assert isinstance(out, bytes), out


def test_get_info_names_a_loadable_tokenizer_and_no_storage_path(tinker_worker, raw_a, tiny_model_dir):
    from transformers import AutoTokenizer

    model = raw_a.model("tiny", seed=1)
    info = raw_a.post("/get_info", json={"model_id": model, "type": "get_info"})
    assert info.status_code == 200, info.text
    body = info.json()
    assert body["model_name"] == "tiny"
    # the folder the model was served from, absolute, which the tinker client can load its tokenizer from
    assert body["model_data"]["tokenizer_id"] == os.path.abspath(tiny_model_dir)
    served = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert AutoTokenizer.from_pretrained(body["model_data"]["tokenizer_id"]).encode("1 + 1") == served.encode("1 + 1")
    assert str(tinker_worker.storage) not in info.text and str(tinker_worker.storage.parent) not in info.text


def test_tokenizer_id_is_the_operators_when_set(tiny_model_dir, tmp_path):
    from support import running_worker

    with running_worker(tiny_model_dir, tmp_path, "--tokenizer-id", "tiny=org/tiny-tokenizer",
                        api_keys=[KEY_A[4:]], in_process=True) as proc:
        raw = RawTinker(proc.base_url, KEY_A)
        info = raw.post("/get_info", json={"model_id": raw.model("tiny", seed=1), "type": "get_info"})
        assert info.json()["model_data"]["tokenizer_id"] == "org/tiny-tokenizer", info.text


@pytest.mark.timeout(120)
def test_open_sessions_are_bounded_per_api_key(raw_a, raw_b):
    from server_mock.config import TinkerOptions

    max_sessions = TinkerOptions().tinker_max_sessions
    opened = []
    while True:
        r = raw_b.post("/create_session", json={"tags": [], "type": "create_session"})
        if r.status_code != 200:
            break
        opened.append(r.json()["session_id"])
        assert len(opened) <= max_sessions
    assert r.status_code == 429 and f"--tinker-max-sessions={max_sessions}" in r.json()["detail"], r.text
    assert raw_a.session().startswith("sess-")  # another API key is not affected
    assert raw_b.post(f"/sessions/{opened[0]}/finish", json={}).status_code == 200
    assert raw_b.session().startswith("sess-")  # a finished session frees its place
    for session in opened[1:]:
        raw_b.post(f"/sessions/{session}/finish", json={})
