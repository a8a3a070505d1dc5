"""The PyTRIO protocol across a worker restart on the same storage (``--durability full``), driven by the raw client:
what the worker answered before a ``kill -9`` it answers the same after it (events by id, re-sent events, sample
retries by request_id, the actor tokens the client holds), nothing runs twice, and events acknowledged before they
could be handed to the service run after the restart, in index order."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import msgpack
import pytest
import torch
import uvicorn
from pytrio_raw import RawClient, Session, datum, envelope, event_id, totals
from support import WorkerProcess

from server_mock.api.pytrio.events import MAX_WAITING
from server_mock.app import create_app
from server_mock.config import PytrioOptions
from server_mock.service.worker import WorkerService

KEY = "restart-key"
ADAM_DEFAULTS = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}
TOKENS = [5, 17, 200, 31, 8, 99, 140, 3]
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]}


def fb(tokens=TOKENS) -> dict:
    return {"data": [datum(tokens, tokens[1:] + [-100])], "auto_shift": False,
            "loss": {"type": "cross_entropy", "config": {}}, "gradient_accumulation": totals(1, len(tokens) - 1)}


def sample(client: RawClient, sampler: dict, body: dict, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token or sampler['actor_jwt']['token']}", "Accept": "application/json"}
    response = client.http.post(f"/pytrio-actor/v1/sampling-runs/{sampler['sampling_run_cuid']}/sample",
                                headers=headers, json=body)
    assert response.status_code == 200, response.text
    return json.loads(response.content)


@pytest.fixture()
def model_id(tiny_model_dir):
    return str(tiny_model_dir.resolve())


def test_answers_tokens_and_samples_are_the_same_after_a_kill(tiny_model_dir, model_id, tmp_path):
    worker = WorkerProcess(tiny_model_dir, tmp_path / "storage", api_keys=[KEY]).start()
    client = RawClient(worker.base_url, KEY)
    try:
        session = Session(client)
        run = session.training_run()
        assert run.init(model_id)["status"] == "succeeded"
        fb_id, optim_id, bad_id = event_id(), event_id(), event_id()
        done_fb = run.run("trainer.forward_backward", fb(), eid=fb_id)
        short = fb()
        short["data"][0]["target_ids"] = short["data"][0]["target_ids"][:-1]
        refused = run.run("trainer.forward_backward", short, eid=bad_id)  # fails when its turn comes: recorded
        assert refused["status"] == "failed"
        done_optim = run.run("trainer.optimize_step", {"adam_params": ADAM_DEFAULTS}, eid=optim_id)
        temporary = run.run("trainer.save_weights", {"name": "temp-sampling-1", "visibility": "TEMPORARY",
                                                     "ttl_seconds": 3600})
        weights = temporary["result"]["checkpoint"]["uri"]
        sampler = session.sampling_run(uri=weights)
        body = {"request_id": "req_1", "prompt": PROMPT, "num_samples": 2,
                "sampling_params": {"max_tokens": 6, "stop_token_ids": []}}  # unseeded: a new sample would differ
        first = sample(client, sampler, body)

        worker.kill()
        worker = WorkerProcess(tiny_model_dir, tmp_path / "storage", api_keys=[KEY]).start(worker.port)

        assert run.poll(fb_id) == done_fb and run.poll(optim_id) == done_optim  # the token still opens the run
        resent = run.submit("trainer.optimize_step", {"adam_params": ADAM_DEFAULTS}, eid=optim_id,
                            index=run.index - 2)
        assert resent == done_optim  # answered from the journal, not run again
        again = run.submit("trainer.forward_backward", short, eid=bad_id, index=run.index - 3)
        assert again == refused
        assert sample(client, sampler, body) == first  # the retry of a request gets its recorded answer
        assert run.run("trainer.forward_backward", fb())["status"] == "succeeded"  # the next index is admitted
        step = run.run("trainer.optimize_step", {"adam_params": ADAM_DEFAULTS})
        assert step["result"]["metrics"]["step"] == 2.0  # the first step ran once, before the kill
        other = sample(client, session.sampling_run(uri=weights), {**body, "request_id": "req_2"})
        assert len(other["sequences"]) == 2  # temporary weights still serve

        renewed = client.control("POST", f"/training-runs/{run.cuid}/renew").json()["actor_jwt"]["token"]
        assert renewed != run.token  # only the token's digest was recorded: a new one is minted
        old = run.token
        assert run.poll(fb_id) == done_fb  # the old token works until its own expiry
        run.token = renewed
        assert run.poll(fb_id) == done_fb
        held = client.control("GET", f"/service-sessions/{session.cuid}")
        assert held.status_code == 200 and held.json()["training_run_cuids"] == [run.cuid]  # still the session's
        assert held.json()["sampling_run_cuids"][0] == sampler["sampling_run_cuid"]
        assert client.control("POST", f"/service-sessions/{session.cuid}/close", json={"status": "ENDED"}
                              ).status_code == 204
        deadline = time.monotonic() + 10
        while client.control("GET", f"/training-runs/{run.cuid}").status_code != 404 and time.monotonic() < deadline:
            time.sleep(0.05)
        for token in (old, renewed):  # released: both die with the run
            run.token = token
            gone = run.submit_bytes(msgpack.packb(envelope("trainer.forward", fb(), run.index, run.cuid)))
            assert (gone.status_code, gone.json()["code"]) == (401, "invalid_token")
    finally:
        client.close()
        worker.stop()


def in_process(service: WorkerService, options: PytrioOptions):
    """The worker in this process (real uvicorn on a loopback port), so that a test can hold what it does."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service, [KEY], pytrio_options=options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_events_acknowledged_before_their_hand_off_run_after_a_restart(tiny_model_dir, model_id, tmp_path):
    # the init_run hangs (as a slow model load would), so the events behind it cannot be handed to the service
    # within --pytrio-ack-wait: each is acknowledged with its body recorded, up to MAX_WAITING of them; one more is
    # refused with its index left free. A new worker on the storage runs them all, in index order, and each answers
    # under its id
    storage = tmp_path / "storage"
    service = WorkerService({"tiny": str(tiny_model_dir)}, storage, "cpu", torch.float32)

    async def hang(*args, **kwargs):
        await asyncio.Event().wait()

    service.runs.create = hang
    server, thread, url = in_process(service, PytrioOptions(pytrio_ack_wait=0.05))
    client = RawClient(url, KEY)
    lora = {"rank": 8, "seed": 7, "train_mlp": True, "train_attn": True, "train_unembed": True}
    probe = fb()
    try:
        run = Session(client).training_run()
        init = run.submit("trainer.init_run", {"base_model": model_id, "lora_config": lora})
        pending = run.submit("trainer.forward_backward", fb())
        optim = run.submit("trainer.optimize_step", {"adam_params": ADAM_DEFAULTS})
        forwards = [run.submit("trainer.forward", probe) for _ in range(MAX_WAITING - 2)]
        assert {a["status"] for a in (init, pending, optim, *forwards)} == {"accepted"}
        late_id = event_id()
        late = run.submit("trainer.forward", probe, eid=late_id, index=run.index)
        assert (late["status"], late["error"]["code"]) == ("failed", "too_many_queued_events")
    finally:
        client.close()
        server.should_exit = True
        thread.join(15)

    worker = WorkerProcess(tiny_model_dir, storage, api_keys=[KEY]).start()
    client = RawClient(worker.base_url, KEY)
    run.client = client
    try:
        assert run.poll(init["event_id"])["status"] == "succeeded"
        ran = run.poll(pending["event_id"])
        stepped = run.poll(optim["event_id"])
        assert ran["status"] == "succeeded" and stepped["status"] == "succeeded"
        looked = [run.poll(f["event_id"]) for f in forwards]
        assert {a["status"] for a in looked} == {"succeeded"}
        # the same events on a fresh run of the same seed: the same loss and the same step, so each ran once, in
        # order (the forwards after the step see the stepped weights)
        fresh = Session(client).training_run()
        assert fresh.init(model_id)["status"] == "succeeded"
        expected = fresh.run("trainer.forward_backward", fb())
        expected_step = fresh.run("trainer.optimize_step", {"adam_params": ADAM_DEFAULTS})
        expected_probe = fresh.run("trainer.forward", probe)
        assert ran["result"]["metrics"] == expected["result"]["metrics"]
        assert stepped["result"]["metrics"] == expected_step["result"]["metrics"]
        assert looked[-1]["result"] == expected_probe["result"]
        again = run.submit("trainer.forward", probe, eid=late_id, index=run.index)  # its index was left free
        while again["status"] in ("accepted", "running"):
            again = run.poll(late_id)
        assert again["status"] == "succeeded"
    finally:
        client.close()
        worker.stop()
