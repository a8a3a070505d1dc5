"""Ordering of training calls, the async conventions, and retries that never apply a call twice."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest

import pytrio_compat as trio
from pytrio_compat.errors import ValidationError


def sequence_datum(offset: int = 0) -> trio.Datum:
    ids = list(range(40 + offset, 60 + offset))
    return trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def weights_probe(tc) -> np.ndarray:
    return np.asarray(tc.forward([sequence_datum(100)]).result().loss_fn_outputs[0]["logprobs"].data)


def test_back_to_back_submission_equals_waiting_between_calls(service):
    adam = trio.AdamParams(learning_rate=1e-2)
    waited = service.create_lora_training_client("tiny", rank=4, seed=2)
    for step in range(4):
        waited.forward_backward([sequence_datum(step)]).result()
        waited.optim_step(adam).result()
    pipelined = service.create_lora_training_client("tiny", rank=4, seed=2)
    futures = []
    for step in range(4):
        futures.append(pipelined.forward_backward([sequence_datum(step)]))
        futures.append(pipelined.optim_step(adam))
    results = [f.result() for f in futures]
    assert [r.metrics["step"] for r in results[1::2]] == [1.0, 2.0, 3.0, 4.0]
    np.testing.assert_array_equal(weights_probe(waited), weights_probe(pipelined))


def test_calls_from_many_threads_run_in_submission_order(service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=2)
    order_lock = threading.Lock()
    submitted = []

    def submit(i: int) -> None:
        with order_lock:  # the order in which calls are made is the order they must run
            submitted.append((i, tc.optim_step(trio.AdamParams(learning_rate=1e-4))))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps = [future.result().metrics["step"] for _, future in submitted]
    assert steps == sorted(steps) == [float(i) for i in range(1, 9)]


def test_async_twins_follow_pytrio_conventions(service):
    async def main():
        tc = await service.create_lora_training_client_async("tiny", rank=4, seed=4)
        fut = await tc.forward_backward_async([sequence_datum()])
        assert isinstance(fut, trio.APIFuture)  # training *_async: a future you await again
        out = await fut
        assert out.metrics["token_count"] == 19.0
        step = await (await tc.optim_step_async(trio.AdamParams(learning_rate=1e-3)))
        assert step.metrics["step"] == 1.0
        sampler = await tc.save_weights_and_get_sampling_client_async()
        response = await sampler.sample_async(trio.ModelInput.from_ints([5, 6, 7]), num_samples=2,
                                              sampling_params=trio.SamplingParams(max_tokens=5, seed=1))
        assert isinstance(response, trio.types.SampleResponse)  # sampling *_async: the value itself
        logprobs = await sampler.compute_logprobs_async(trio.ModelInput.from_ints([5, 6, 7]))
        assert logprobs[0] is None and len(logprobs) == 3
        both = await asyncio.gather(*[sampler.sample_async(trio.ModelInput.from_ints([9, 9]),
                                                           sampling_params=trio.SamplingParams(max_tokens=3, seed=s))
                                      for s in range(4)])
        assert len(both) == 4

    asyncio.run(main())


class DropFirstResponse(httpx.AsyncBaseTransport):
    """Forwards every request, but loses the response of the first matching one (as a flaky network would)."""

    def __init__(self, match: str) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.match = match
        self.dropped = 0
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if self.match in request.url.path and request.method == "POST":
            self.sent += 1
            if self.dropped == 0:
                await response.aread()
                self.dropped += 1
                raise httpx.ReadError("connection reset while reading the response", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_lost_response_is_retried_without_applying_the_call_twice(worker, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTRIO_COMPAT_CACHE", str(tmp_path))
    trio.configure(retry_initial_delay_seconds=0.05)
    transport = DropFirstResponse("/ops")
    client = trio.ServiceClient(base_url=worker.base_url, _transport=transport)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=8)
        result = tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
        assert transport.dropped == 1 and transport.sent == 2  # the optim_step was sent twice...
        assert result.metrics["step"] == 1.0  # ...and applied once
        assert tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result().metrics["step"] == 2.0
    finally:
        client.close()
        trio.configure(retry_initial_delay_seconds=0.5)


def test_client_side_validation_happens_before_any_request(service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=1)
    before = tc._next_seq
    good = sequence_datum()
    with pytest.raises(ValidationError) as err:
        tc.forward_backward([])
    assert err.value.code == "validation.empty_training_data"
    with pytest.raises(ValueError, match="Unsupported loss function"):
        tc.forward_backward([good], "gspo")
    with pytest.raises(ValueError, match="logprobs is required"):
        tc.forward_backward([good], "ppo")
    with pytest.raises(ValueError, match=r"target_tokens must have shape \[19\]"):
        tc.forward_backward([trio.Datum(model_input=good.model_input, loss_fn_inputs={"target_tokens": [1, 2]})])
    with pytest.raises(ValidationError) as err:
        tc.forward_backward([trio.Datum(model_input=trio.ModelInput.from_ints([1, 10**6]),
                                        loss_fn_inputs={"target_tokens": [1, 2]})])
    assert err.value.code == "validation.token_id_out_of_range" and err.value.details["field"] == "input_ids"
    bad_lp = trio.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"], "logprobs": [float("nan")] * 19,
        "advantages": [0.0] * 19})
    with pytest.raises(ValueError, match=r"logprobs\[0\] must be finite"):
        tc.forward_backward([bad_lp], "importance_sampling")
    with pytest.raises(ValidationError) as err:
        tc.save_state("bad/name")
    assert err.value.code == "validation.invalid_checkpoint_name"
    with pytest.raises(ValidationError) as err:
        service.create_lora_training_client("tiny", rank=2)
    assert err.value.code == "validation.invalid_lora_rank"
    sampler = tc.save_weights_and_get_sampling_client()
    with pytest.raises(ValidationError, match="max_tokens"):
        sampler.sample(trio.ModelInput.from_ints([1, 2]), sampling_params=trio.SamplingParams())
    with pytest.raises(ValidationError, match="empty"):
        sampler.sample(trio.ModelInput.from_ints([]), sampling_params=trio.SamplingParams(max_tokens=3))
    assert tc._next_seq == before + 1  # only the sampler snapshot was sent


def test_worker_errors_surface_with_the_field_named(service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=1)
    with pytest.raises(trio.PyTrioError) as err:
        d = sequence_datum()
        policy = trio.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": [-1.0] * 19, "advantages": [1.0] * 19})
        tc.forward_backward([policy], "ppo", {"clip_low_threshold": 2.0}).result()
    assert "clip" in str(err.value)
    with pytest.raises(trio.PyTrioError) as err:
        service.create_lora_training_client("no-such-model")
    assert err.value.status_code == 404 and "no-such-model" in str(err.value)
