"""The smaller holes between tenants and in what the worker accepts: per-tenant idempotency and resend caches,
no batching across tenants, checkpoint listings that read only the caller's folders, API keys out of the process
list, lazy model loading behind an allow-list with one answer for every model that cannot be had, and 4xx (never
500) for token ids past 64 bits, lone surrogates, names ending in a newline, a learning rate that would make the
weights infinite, and a target_modules pattern that backtracks for days."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from support import InProcessWorker, running_worker

from server_mock.api.native.endpoint import Idempotency
from server_mock.api.tinker.state import TinkerState
from server_mock.config import Limits, TinkerOptions
from server_mock.storage.checkpoints import CheckpointRef, CheckpointStore

from .reliability_helpers import KEY_A, KEY_B, datum_wire

KEY_C = "key-tenant-c"
JSON_TYPE = {"Content-Type": "application/json"}


# --- caches of one tenant never evict another's -------------------------------------------------------------------


def test_idempotency_keys_are_kept_per_tenant():
    async def scenario():
        cache = Idempotency(keep=3)
        made = []

        async def make():
            made.append(len(made))
            return {"object": made[-1]}

        def request(key: str):
            return SimpleNamespace(headers={"idempotency-key": key})

        first_b = await cache.remember(request("k"), "B", make)
        for i in range(10):  # A's flood: far more keys than the cache keeps
            await cache.remember(request(f"a{i}"), "A", make)
        assert await cache.remember(request("k"), "B", make) == first_b  # B's resend: the first answer
        assert await cache.remember(request("k"), "A", make) != first_b  # the same key is A's own
        assert await cache.remember(request("a9"), "A", make) == {"object": 10}  # A keeps its newest 3
        assert await cache.remember(request("a0"), "A", make) == {"object": 12}  # ...its oldest are made again

    asyncio.run(scenario())


def test_tinker_asample_resends_are_remembered_per_tenant():
    service = SimpleNamespace(limits=Limits(), requests=SimpleNamespace(result_ttl=60.0), samplers=None)
    state = TinkerState(service, TinkerOptions(tinker_sample_ids=50))
    state.samples.put("s-b:1", "B", ("tk-b", [], "digest"))
    for i in range(50 + 10):
        state.samples.put(f"s-a:{i}", "A", ("tk-a", [], "digest"))
    assert state.samples.get("s-b:1") == ("tk-b", [], "digest")
    assert state.samples.count("A") == 50 and state.samples.get("s-a:0") is None


def _fault_worker(tiny_model_dir, tmp_path, *extra, keys=(KEY_A, KEY_B, KEY_C)) -> InProcessWorker:
    return InProcessWorker(tiny_model_dir, tmp_path / "storage", *extra, api_keys=list(keys),
                           env={"PYTRIO_WORKER_FAULT_INJECTION": "1"}).start()


def test_a_tenants_samples_are_never_batched_with_anothers(tiny_model_dir, tmp_path):
    """While the model is busy, A queues six base-model samples and B one: A's six decode together, B's alone,
    so B's answer (batch_requests, timings) says nothing of A's traffic."""
    proc = _fault_worker(tiny_model_dir, tmp_path)
    try:
        def client(key):
            return httpx.Client(base_url=proc.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

        with client(KEY_A) as a, client(KEY_B) as b, client(KEY_C) as c:
            run = c.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2}}).json()
            busy = c.post(f"/v1/training_runs/{run['training_run_id']}/ops", json={"seq_id": 1, "payload": {
                "op": "forward", "data": [datum_wire()],
                "loss_fn_config": {"fault_injection": {"delay_seconds": 2}}}}).json()["request_id"]
            time.sleep(0.3)  # C's op holds the model's thread
            body = {"prompt_tokens": [5, 6, 7], "sampling_params": {"max_tokens": 3, "seed": 1}}
            sa = a.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
            sb = b.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
            mine = [a.post(f"/v1/samplers/{sa}/sample", json=body).json()["request_id"] for _ in range(6)]
            theirs = b.post(f"/v1/samplers/{sb}/sample", json=body).json()["request_id"]
            assert c.get(f"/v1/requests/{busy}", params={"wait": 30}).json()["status"] == "succeeded"

            def metrics(http, rid):
                status = http.get(f"/v1/requests/{rid}", params={"wait": 30}).json()
                assert status["status"] == "succeeded", status
                return status["result"]["metrics"]

            assert [metrics(a, rid)["batch_requests"] for rid in mine] == [6.0] * 6
            assert metrics(b, theirs)["batch_requests"] == 1.0
    finally:
        proc.stop()


# --- checkpoint listings read only the caller's folders -----------------------------------------------------------


def test_listing_a_tenants_checkpoints_reads_only_its_own_runs(tmp_path, monkeypatch):
    from server_mock.service.checkpoints import Checkpoints
    from server_mock.service.quotas import TenantLRU

    old = CheckpointStore(tmp_path)
    tensors = {"adapter_model.safetensors": {"w": torch.zeros(2)}}
    for i in range(30):
        old.write(CheckpointRef(f"run-a{i}", "sampler", "w"), {"tenant": "A", "base_model": "tiny"}, tensors, {})
    old.write(CheckpointRef("run-b0", "sampler", "w"), {"tenant": "B", "base_model": "tiny"}, tensors, {})
    store = CheckpointStore(tmp_path)  # a restarted worker: the index is read back from the existing folders
    store.build_index()
    touched: list[str] = []
    for name in ("iterdir", "read_text", "exists", "is_dir"):
        original = getattr(Path, name)

        def spy(self, *args, _original=original, **kwargs):
            touched.append(str(self))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Path, name, spy)
    entries = Checkpoints(store, TenantLRU(4)).entries("B", None)
    monkeypatch.undo()
    assert [e.path for e, _ in entries] == ["trio://run-b0/sampler/w"]
    assert touched and not [p for p in touched if "run-a" in p], [p for p in touched if "run-a" in p][:3]
    assert len(Checkpoints(store, TenantLRU(4)).entries("A", None)) == 30
    store.write(CheckpointRef("run-b1", "state", "s"), {"tenant": "B", "base_model": "tiny"}, tensors, {})
    assert len(Checkpoints(store, TenantLRU(4)).entries("B", None)) == 2  # kept up to date by writes


# --- API keys out of the process list; lazy models behind an allow-list ---------------------------------------------


def _serve(*args: str) -> SimpleNamespace:
    """``pytrio-worker serve`` with these arguments, run in this process up to where it would listen: its exit
    status and what it wrote to stderr, as a child process would show them (a refusal is ``sys.exit(message)`` or
    argparse's error). Arguments it accepts give status 0, their socket (a free port unless they name one) closed
    again and their storage (a scratch folder unless they name one) removed."""
    from server_mock.cli import build_parser, build_server

    err = io.StringIO()
    with contextlib.redirect_stderr(err), tempfile.TemporaryDirectory() as scratch:
        try:
            _, sock = build_server(build_parser().parse_args(["serve", "--port", "0", "--storage", scratch, *args]))
        except SystemExit as exit_:
            code = exit_.code
            if isinstance(code, str):
                print(code, file=sys.stderr)
            return SimpleNamespace(returncode=code if isinstance(code, int) else 1, stderr=err.getvalue())
    sock.close()
    return SimpleNamespace(returncode=0, stderr=err.getvalue())


def test_api_keys_from_a_file_stay_out_of_the_process_list(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# the tenants\n{KEY_A}\n\n{KEY_B}  # second\n")
    keys.chmod(0o600)
    with running_worker(tiny_model_dir, tmp_path, "--api-key-file", str(keys), warm=False) as proc:
        cmdline = Path(f"/proc/{proc.process.pid}/cmdline").read_bytes()
        assert KEY_A.encode() not in cmdline and KEY_B.encode() not in cmdline
        for key in (KEY_A, KEY_B):
            assert httpx.get(proc.base_url + "/v1/whoami", headers={"Authorization": f"Bearer {key}"}).status_code \
                == 200
        assert httpx.get(proc.base_url + "/v1/whoami").status_code == 401
        assert httpx.get(proc.base_url + "/v1/whoami", headers={"Authorization": "Bearer # the tenants"}
                         ).status_code == 401
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    result = _serve("--model", f"tiny={tiny_model_dir}", "--api-key-file", str(empty))
    assert result.returncode != 0 and "holds no keys" in result.stderr


def test_lazy_models_with_keys_need_an_allow_list_and_answer_one_message(tiny_model_dir, tmp_path):
    refused = _serve("--lazy-models", "--api-key", KEY_A, "--port", "0")
    assert refused.returncode != 0 and "--lazy-model-allow" in refused.stderr, refused.stderr
    allowed = tmp_path / "models"
    (allowed / "not-a-model").mkdir(parents=True)
    (allowed / "not-a-model" / "config.json").write_text("{}")
    with running_worker(tiny_model_dir, tmp_path, "--lazy-models", "--lazy-model-allow", f"{allowed}/*",
                        "--lazy-model-allow", str(tiny_model_dir), api_keys=[KEY_A], in_process=True) as proc:
        with httpx.Client(base_url=proc.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
            answers = {}
            for name in ("/etc", "/proc/self", str(allowed / "missing"), str(allowed / "not-a-model"),
                         f"{allowed}/../../..", "no/such-hub-model"):
                r = http.post("/v1/samplers", json={"base_model": name})
                answers[name] = (r.status_code, r.json()["error"]["code"],
                                 re.sub(r"model '.*?' is not served", "model NAME is not served",
                                        r.json()["error"]["message"]))
            assert len(set(answers.values())) == 1, answers  # the same answer whatever exists on the machine
            assert next(iter(answers.values()))[:2] == (404, "model_not_found")
            assert http.post("/v1/samplers", json={"base_model": str(tiny_model_dir)}).status_code == 200


# --- bad values are 4xx, never 500, and change nothing --------------------------------------------------------------


def test_out_of_range_ids_surrogates_and_newlines_are_refused(tiny_model_dir, tmp_path):
    with running_worker(tiny_model_dir, tmp_path, api_keys=[KEY_A], in_process=True) as proc:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        with httpx.Client(base_url=proc.base_url, headers=auth, timeout=60) as http:
            sampler = http.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
            for body, field in [({"prompt_tokens": [1, 2**63], "sampling_params": {"max_tokens": 2}}, "prompt_tokens"),
                                ({"prompt_tokens": [1, -(2**70)], "sampling_params": {"max_tokens": 2}},
                                 "prompt_tokens"),
                                ({"prompt_tokens": [1], "sampling_params": {"max_tokens": 2,
                                                                            "stop_token_ids": [2**64]}},
                                 "sampling_params.stop_token_ids")]:
                r = http.post(f"/v1/samplers/{sampler}/sample", json=body)
                assert r.status_code == 400 and r.json()["error"]["code"] == "token_id_out_of_range", r.text
                assert r.json()["error"]["field"] == field, r.text
            # a lone surrogate (JSON allows the escape; it is not text) is refused while the body is parsed
            openai = proc.base_url + "/api/openai/v1"
            for path, body in [
                    ("/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}'),
                    ("/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": '
                                          '"text", "text": "\\udfff"}]}]}'),
                    ("/completions", '{"model": "tiny", "prompt": "x\\ud83d"}'),
                    ("/completions", '{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}')]:
                r = httpx.post(openai + path, content=body, headers={**auth, "Content-Type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (path, r.text)
            r = httpx.post(openai + "/completions", content='{"model": "tiny", "prompt": [1, 2, 34028236692093846346337'
                                                            '4607431768211456]}', headers={**auth, **JSON_TYPE})
            assert r.status_code == 400 and r.json()["error"]["code"] == "token_id_out_of_range", r.text
            r = http.post(f"/v1/samplers/{sampler}/sample", content='{"prompt_tokens": [1], "sampling_params": '
                                                                  '{"max_tokens": 2, "stop": ["\\ud800"]}}',
                          headers=JSON_TYPE)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2}}).json()
            r = http.post(f"/v1/training_runs/{run['training_run_id']}/ops",
                          json={"seq_id": 1, "payload": {"op": "save_state", "name": "x\n"}})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_checkpoint_name", r.text
            huge_seed = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2, "seed": 2**70}})
            assert huge_seed.status_code == 422 and "lora.seed" in huge_seed.text, huge_seed.text
        tinker = httpx.Client(base_url=proc.base_url + "/api/v1", headers={"X-API-Key": KEY_A}, timeout=60)
        with tinker:
            session = tinker.post("/create_session", json={"tags": []}).json()["session_id"]
            created = tinker.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                                         "base_model": "tiny", "lora_config": {"rank": 2}}).json()
            tinker.post("/retrieve_future", json={"request_id": created["request_id"]})
            saved = tinker.post("/save_weights", json={"model_id": created["model_id"], "seq_id": 1, "path": "x\n"})
            failure = tinker.post("/retrieve_future", json={"request_id": saved.json()["request_id"]}).json()
            assert failure["category"] == "user" and "invalid checkpoint name" in failure["error"], failure
            sampling = tinker.post("/create_sampling_session", json={"session_id": session,
                                                                      "sampling_session_seq_id": 0,
                                                                      "base_model": "tiny"}).json()
            sent = tinker.post("/asample", json={"sampling_session_id": sampling["sampling_session_id"], "prompt": {
                "chunks": [{"tokens": [1, 2**63]}]}, "sampling_params": {"max_tokens": 2}}).json()
            failure = tinker.post("/retrieve_future", json={"request_id": sent["request_id"]}).json()
            assert failure["category"] == "user" and "outside the vocabulary" in failure["error"], failure
    log = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]


def test_a_step_that_would_make_the_weights_infinite_is_refused_and_changes_nothing(tiny_model_dir, tmp_path):
    from server_mock.storage.checkpoints import parse_path

    with running_worker(tiny_model_dir, tmp_path, in_process=True) as proc:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2, "seed": 3}}).json()
            url, seq = f"/v1/training_runs/{run['training_run_id']}/ops", iter(range(1, 100))

            def op(payload) -> dict:
                rid = http.post(url, json={"seq_id": next(seq), "payload": payload}).json()["request_id"]
                return http.get(f"/v1/requests/{rid}", params={"wait": 30}).json()

            def fingerprint(name):
                path = op({"op": "save_state", "name": name})["result"]["path"]
                return CheckpointStore(proc.storage).fingerprint(parse_path(path))

            forward = {"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum_wire()]}
            op(forward)
            op({"op": "optim_step", "adam_params": {"learning_rate": 1e-2}})
            op(forward)  # a gradient pending
            before = fingerprint("before")
            for adam in ({"learning_rate": 1e30}, {"learning_rate": 1e20, "weight_decay": 1e20},
                         {"learning_rate": 1e18}):
                refused = op({"op": "optim_step", "adam_params": adam})
                assert refused["status"] == "failed" and refused["error"]["code"] == "non_finite_update", refused
                assert refused["error"]["field"] == "adam_params.learning_rate"
            assert fingerprint("after") == before  # weights, Adam state; the pending gradient is still there
            stepped = op({"op": "optim_step", "adam_params": {"learning_rate": 1e-2}})
            assert stepped["status"] == "succeeded" and stepped["result"]["metrics"]["grad_norm"] > 0, stepped
            sampler = http.post("/v1/samplers", json={"model_path": op({"op": "save_weights_for_sampler",
                                                                         "name": "w"})["result"]["path"]}).json()
            rid = http.post(f"/v1/samplers/{sampler['sampler_id']}/sample", json={
                "prompt_tokens": [5, 6], "sampling_params": {"max_tokens": 3}}).json()["request_id"]
            assert http.get(f"/v1/requests/{rid}", params={"wait": 30}).json()["status"] == "succeeded"


def test_a_backtracking_target_modules_pattern_is_cut_off(tiny_model_dir, tmp_path):
    allowed = tmp_path / "adapters"
    folder = allowed / "evil"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                            "target_modules": "(?:(?:.*?)+)+y"}))
    (folder / "adapter_model.safetensors").write_bytes(b"never read")
    with running_worker(tiny_model_dir, tmp_path, "--allow-adapter-dir", str(allowed), in_process=True) as proc:
        started = time.perf_counter()
        r = httpx.post(proc.base_url + "/v1/samplers", json={"model_path": str(folder), "base_model": "tiny"},
                       timeout=120)
        elapsed = time.perf_counter() - started
        assert r.status_code == 400 and "target_modules" in r.text and "list of layer names" in r.text, r.text
        assert elapsed < 10, elapsed  # with re, this pattern backtracks for days on the first layer name
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                                "target_modules": "(unclosed"}))
        r = httpx.post(proc.base_url + "/v1/samplers", json={"model_path": str(folder), "base_model": "tiny"})
        assert r.status_code == 400 and "not a valid regular expression" in r.text, r.text


def test_a_refused_tinker_op_uses_up_its_seq_id(tiny_model_dir, tmp_path):
    """An optim_step whose body is refused answers 400 at once, and its seq_id is used up, so the model's next
    request is not held back waiting for it."""
    with running_worker(tiny_model_dir, tmp_path, api_keys=[KEY_A], in_process=True) as proc:
        with httpx.Client(base_url=proc.base_url + "/api/v1", headers={"X-API-Key": KEY_A}, timeout=60) as http:
            session = http.post("/create_session", json={"tags": []}).json()["session_id"]
            created = http.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": "tiny", "lora_config": {"rank": 2}}).json()
            http.post("/retrieve_future", json={"request_id": created["request_id"]})
            model = created["model_id"]
            bad = http.post("/optim_step", json={"model_id": model, "seq_id": 1,
                                                 "adam_params": {"learning_rate": "fast"}})
            assert bad.status_code == 400 and bad.json()["field"] == "adam_params.learning_rate", bad.text
            started = time.perf_counter()
            good = http.post("/optim_step", json={"model_id": model, "seq_id": 2,
                                                  "adam_params": {"learning_rate": 1e-3}}).json()
            answer = http.post("/retrieve_future", json={"request_id": good["request_id"]}).json()
            assert answer.get("metrics", {}).get("step:max") == 1.0, answer
            assert time.perf_counter() - started < 20  # a gap is skipped only after 60 s


def test_limits_past_the_request_shapes_bounds_are_refused_at_start(tiny_model_dir):
    result = _serve("--model", f"tiny={tiny_model_dir}", "--max-seq-len", str(1 << 25))
    assert result.returncode != 0 and "--max-seq-len must be <= 16777216" in result.stderr, result.stderr
    assert _serve("--model", f"tiny={tiny_model_dir}", "--max-zstd-ratio", "0").returncode != 0


@pytest.mark.parametrize("flag", ["--request-timeout", "--max-connections", "--max-parsing-bytes"])
def test_connection_and_parse_settings_must_be_positive(tiny_model_dir, flag):
    result = _serve("--model", f"tiny={tiny_model_dir}", flag, "0")
    assert result.returncode != 0 and flag in result.stderr, result.stderr
