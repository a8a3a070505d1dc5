"""The client across a worker restart. With ``--durability checkpoint-only`` in-flight calls fail with an error naming
their request (never hang), new calls reconnect, and an old TrainingClient is told its run is unknown; with ``full``
(the default) the same calls finish after the restart and the old TrainingClient carries on."""

from __future__ import annotations

import time

import pytest
from support import WorkerProcess

import pytrio_compat as trio
from pytrio_compat import config
from pytrio_compat.errors import ConnectionFailedError, RequestLostError

from .reliability_helpers import datum

SLOW = {"fault_injection": {"delay_seconds": 30}}  # keeps a request in flight while the worker dies


@pytest.fixture()
def restartable(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTRIO_WORKER_FAULT_INJECTION", "1")
    workers = []

    def start(port: int = 0, *extra: str) -> WorkerProcess:
        workers.append(WorkerProcess(tiny_model_dir, tmp_path / "storage", *extra).start(port))
        return workers[-1]

    yield start
    for worker in workers:
        worker.stop()


CHECKPOINT_ONLY = ("--durability", "checkpoint-only")


def test_restart_fails_in_flight_calls_clearly_and_new_calls_reconnect(restartable, fast_retries, client_cache,
                                                                      monkeypatch):
    worker = restartable(0, *CHECKPOINT_ONLY)
    client = trio.ServiceClient(base_url=worker.base_url)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=1)
        tc.forward_backward([datum()]).result()
        saved = tc.save_state("before-restart").result().path
        in_flight = tc.forward_backward([datum(1)], loss_fn_config=SLOW)
        time.sleep(1.5)  # the slow call reaches the model's thread first, so the sample below waits behind it
        sampler = client.create_sampling_client(base_model="tiny")
        queued = sampler.sample(trio.ModelInput.from_ints([3, 4, 5]), sampling_params=trio.SamplingParams(max_tokens=3))
        time.sleep(0.5)
        worker.kill()
        time.sleep(1.0)  # the client keeps trying to reach the worker meanwhile
        assert not in_flight.done() and not queued.done()
        worker = restartable(worker.port, *CHECKPOINT_ONLY)

        started = time.monotonic()
        with pytest.raises(RequestLostError) as lost_fb:
            in_flight.result(timeout=30)
        with pytest.raises(RequestLostError) as lost_sample:
            queued.result(timeout=30)
        assert time.monotonic() - started < 15
        for err, operation in ((lost_fb.value, "forward_backward"), (lost_sample.value, "sample")):
            assert err.request_id and err.request_id in str(err) and operation in str(err)
            assert "restarted" in str(err)

        with pytest.raises(trio.PyTrioError) as old_run:  # the run lived in the old worker's memory
            tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=30)
        assert old_run.value.status_code == 404 and "unknown training run" in str(old_run.value)

        # the same ServiceClient carries on: new runs, resuming from disk, sampling
        fresh = client.create_lora_training_client("tiny", rank=4, seed=1)
        assert fresh.forward_backward([datum()]).result().metrics["token_count"] == 19.0
        resumed = client.create_training_client_from_state(saved)
        resumed.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
        sample = client.create_sampling_client(base_model="tiny").sample(
            trio.ModelInput.from_ints([3, 4, 5]), sampling_params=trio.SamplingParams(max_tokens=3)).result()
        assert len(sample.sequences[0].tokens) > 0

        # a worker that stays down: in-flight calls fail once the retry window is over, naming the request
        monkeypatch.setattr(config._CONFIG, "training_retry_timeout_seconds", 2)
        impatient = trio.ServiceClient(base_url=worker.base_url)
        try:
            doomed = impatient.create_lora_training_client("tiny", rank=4, seed=1).forward_backward(
                [datum()], loss_fn_config=SLOW)
            time.sleep(0.3)
            worker.kill()
            started = time.monotonic()
            with pytest.raises(ConnectionFailedError) as err:
                doomed.result(timeout=30)
            assert time.monotonic() - started < 10
            assert err.value.request_id and err.value.request_id.startswith("req-")
            assert f"waiting for request {err.value.request_id} (forward_backward)" in str(err.value)
        finally:
            impatient.close()
    finally:
        client.close()


def test_full_durability_finishes_in_flight_calls_and_keeps_the_run(restartable, fast_retries, client_cache):
    worker = restartable()
    client = trio.ServiceClient(base_url=worker.base_url)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=1)
        tc.forward_backward([datum()]).result()
        done_before = tc.optim_step(trio.AdamParams(learning_rate=1e-3))
        done_before.result()
        in_flight = tc.forward_backward([datum(1)], loss_fn_config={"fault_injection": {"delay_seconds": 3}})
        time.sleep(1.0)  # the slow call is on the model's thread
        sampler = client.create_sampling_client(base_model="tiny")
        queued = sampler.sample(trio.ModelInput.from_ints([3, 4, 5]), sampling_params=trio.SamplingParams(
            max_tokens=3, seed=4))
        time.sleep(0.5)
        worker.kill()
        assert not in_flight.done() and not queued.done()
        worker = restartable(worker.port)

        # the op accepted before the kill runs again after it (the 3 s delay included) under its request id
        assert in_flight.result(timeout=60).metrics["token_count"] == 19.0
        assert len(queued.result(timeout=60).sequences[0].tokens) == 3
        # the run, its seq_ids and the sampler are known: the same clients carry on
        step = tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=30)
        assert step.metrics["step"] == 2.0
        again = sampler.sample(trio.ModelInput.from_ints([3, 4, 5]), sampling_params=trio.SamplingParams(
            max_tokens=3, seed=4)).result(timeout=30)
        assert again.sequences[0].tokens == queued.result().sequences[0].tokens
        assert worker.alive()
    finally:
        client.close()
