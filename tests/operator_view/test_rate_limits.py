"""Per-key token budgets (``--tokens-per-minute``), on a fake clock: the bucket itself at the budget and one token
past it, then every protocol answering 429 with an honest ``Retry-After`` and each official client (our SDK,
openai, pytrio) retrying until the request goes through; nothing is dropped and nothing changes on a refusal.
PyTRIO training events, which the SDK cannot resend, wait for the budget instead, and so do Tinker requests (their
futures report ``paused_rate_limit`` meanwhile)."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

import pytrio_compat as trio
from pytrio_compat.types.tensor import WireTensor
from server_mock.api.auth import tenant_id
from server_mock.config import Limits
from server_mock.service import rate_limits
from server_mock.service.rate_limits import RateLimited, TokenBudgets

from .operator_support import TENANT_KEY, FakeClock, operator_worker

BUDGET = 120  # tokens a minute: 2 a second


# --- the bucket --------------------------------------------------------------------------------------------------


def test_a_request_at_the_budget_passes_and_one_token_past_it_is_refused():
    clock = FakeClock()
    budgets = TokenBudgets(BUDGET, clock)
    budgets.take("a", BUDGET)  # exactly the budget, from a full bucket
    with pytest.raises(RateLimited) as refused:
        budgets.take("a", 1)
    assert refused.value.status == 429 and refused.value.retry_after == 1  # 1 token at 2/s: 0.5 s, rounded up
    assert budgets.wait_seconds("a", 1) == pytest.approx(0.5)
    clock.advance(0.49)
    with pytest.raises(RateLimited):
        budgets.take("a", 1)
    clock.advance(0.01)
    budgets.take("a", 1)  # 0.5 s later it fits


def test_what_is_left_is_exact_and_a_refusal_charges_nothing():
    clock = FakeClock()
    budgets = TokenBudgets(BUDGET, clock)
    budgets.take("a", 50)
    with pytest.raises(RateLimited) as refused:
        budgets.take("a", 71)  # 70 are left
    assert refused.value.retry_after == 1 and "70 are left" in refused.value.message
    budgets.take("a", 70)  # at what is left: the refusal took nothing
    with pytest.raises(RateLimited) as refused:
        budgets.take("a", 30)
    assert refused.value.retry_after == 15  # 30 tokens at 2/s
    clock.advance(15)
    budgets.take("a", 30)


def test_the_bucket_refills_to_the_budget_and_no_further():
    clock = FakeClock()
    budgets = TokenBudgets(BUDGET, clock)
    budgets.take("a", BUDGET)
    clock.advance(3600)
    budgets.take("a", BUDGET)
    with pytest.raises(RateLimited):
        budgets.take("a", 1)
    budgets.give_back("a", 10_000)  # a refund never raises the bucket past the budget
    budgets.take("a", BUDGET)
    with pytest.raises(RateLimited):
        budgets.take("a", 1)


def test_a_request_larger_than_the_budget_waits_for_a_full_bucket_then_passes():
    clock = FakeClock()
    budgets = TokenBudgets(BUDGET, clock)
    budgets.take("a", 1)
    with pytest.raises(RateLimited) as refused:
        budgets.take("a", 500)
    assert refused.value.retry_after == 1  # it needs a full bucket: 1 token short
    clock.advance(0.5)
    budgets.take("a", 500)  # accepted whole; the bucket owes 380 tokens
    with pytest.raises(RateLimited) as refused:
        budgets.take("a", 2)
    assert refused.value.retry_after == 191  # (380 + 2) / 2 per second


def test_free_requests_keys_and_own_budgets():
    clock = FakeClock()
    budgets = TokenBudgets(BUDGET, clock)
    budgets.set("unlimited", 0)
    budgets.set("small", 6)
    budgets.take("a", BUDGET)
    budgets.take("a", 0)  # an optimizer step costs nothing, even on an empty bucket
    budgets.take("b", BUDGET)  # another key's bucket is its own
    budgets.take("unlimited", 10**9)
    budgets.take("small", 6)
    with pytest.raises(RateLimited) as refused:
        budgets.take("small", 1)
    assert refused.value.retry_after == 10  # 6 a minute: one every 10 s
    assert TokenBudgets(0, clock).wait_seconds("x", 10**9) == 0  # no budget configured: no limit


def test_ready_waits_until_the_request_fits(monkeypatch):
    monkeypatch.setattr(rate_limits, "READY_POLL_SECONDS", 0.01)
    clock = FakeClock()
    budgets = TokenBudgets(BUDGET, clock)
    seen = []
    budgets.on_limited = seen.append
    budgets.take("a", BUDGET)

    async def main() -> float:
        waiter = asyncio.ensure_future(budgets.ready("a", 10))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        clock.advance(4.9)
        await asyncio.sleep(0.05)
        assert not waiter.done()  # 9.8 tokens: not yet
        clock.advance(0.1)
        await asyncio.wait_for(waiter, 2)
        return budgets.wait_seconds("a", 10)

    assert asyncio.run(main()) == 0
    assert seen == ["a"]


# --- every protocol ------------------------------------------------------------------------------------------------


@pytest.fixture()
def limited(tiny_model_dir, tmp_path):
    """A worker with a budget of BUDGET tokens a minute for every key, its clock in the test's hands."""
    with operator_worker(tiny_model_dir, tmp_path / "storage", limits=Limits(tokens_per_minute=BUDGET),
                         model_name=str(tiny_model_dir)) as running:
        clock = FakeClock()
        running.service.budgets.clock = clock
        running.clock = clock
        yield running


def limited_count(service) -> float:
    return sum(s.value for family in service.usage.metrics.rate_limited.collect() for s in family.samples
               if s.name.endswith("_total"))


def answers(service, protocol: str, code: str) -> float:
    return sum(s.value for family in service.usage.metrics.requests.collect() for s in family.samples
               if s.name.endswith("_total") and s.labels == {"protocol": protocol, "code": code})


@contextmanager
def refill_when_limited(running):
    """Each time a request is held back by its budget, a minute passes on the budget's clock."""
    stop, seen = threading.Event(), [limited_count(running.service)]

    def watch() -> None:
        while not stop.is_set():
            count = limited_count(running.service)
            if count > seen[0]:
                seen[0] = count
                running.clock.advance(60)
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)


def _wire(first: int, n: int) -> dict:
    ids = np.arange(first, first + n + 1, dtype=np.int64)
    return {"tokens": WireTensor.from_array(ids[:-1]).model_dump(),
            "loss_fn_inputs": {"target_tokens": WireTensor.from_array(ids[1:]).model_dump()}}


def test_native_429_names_the_wait_and_the_same_op_goes_through_later(limited):
    http = httpx.Client(base_url=limited.url, headers={"authorization": f"Bearer {TENANT_KEY}"}, timeout=60)
    model = limited.service.models.sources and next(iter(limited.service.models.sources))
    run = http.post("/v1/training_runs", json={"base_model": model, "lora": {"rank": 4}}).json()["training_run_id"]

    def op(seq: int, lengths: list[int]) -> httpx.Response:
        return http.post(f"/v1/training_runs/{run}/ops", json={"seq_id": seq, "payload": {
            "op": "forward_backward", "loss_fn": "cross_entropy", "data": [_wire(10, n) for n in lengths]}})

    assert op(1, [60, 60]).status_code == 200  # at the budget
    refused = op(2, [1])  # one token past it
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limited"
    limited.clock.advance(0.4)
    assert op(2, [1]).status_code == 429  # 0.8 tokens back: not yet
    limited.clock.advance(0.1)
    accepted = op(2, [1])  # the same seq_id: the refusal used nothing up
    assert accepted.status_code == 200 and not accepted.json()["duplicate"]
    result = http.get(f"/v1/requests/{accepted.json()['request_id']}", params={"wait": 30}).json()
    assert result["status"] == "succeeded"
    http.close()


def test_our_sdk_retries_a_429_until_the_budget_allows(limited):
    client = trio.ServiceClient(base_url=limited.url, api_key=TENANT_KEY)
    model = next(iter(limited.service.models.sources))
    tc = client.create_lora_training_client(model, rank=4)
    ids = list(range(10, 71))
    at_budget = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([at_budget, at_budget]).result()  # 120 tokens
    sampler = tc.save_weights_and_get_sampling_client("b")  # costs nothing, even on an empty bucket
    with refill_when_limited(limited) as seen:
        small = trio.Datum(model_input=trio.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7]})
        out = tc.forward_backward([small]).result(timeout=60)  # 2 tokens past an empty bucket
        left = limited.service.budgets.left(tenant_id(TENANT_KEY))
        # 3 prompt tokens + 2 x max_tokens: one token more than is left
        params = trio.SamplingParams(max_tokens=int(left - 3 + 1 + 1) // 2, seed=1)
        sample = sampler.sample(trio.ModelInput.from_ints([5, 6, 7]), num_samples=2, sampling_params=params)
        result = sample.result(timeout=60)
    assert len(out.loss_fn_outputs) == 1 and len(result.sequences) == 2
    assert seen[0] >= 2 and answers(limited.service, "native", "429") >= 2
    client.close()


@pytest.mark.slow  # an official client, in real time
def test_the_tinker_sdk_is_held_not_refused_until_the_budget_allows(limited, tiny_model_dir):
    """Tinker requests over the budget are accepted and held (the SDK shows ``paused_rate_limit``:
    tests/tinker/test_tinker_rate_limit.py), so the worker answers no 429 for them."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=limited.url, api_key="tml-" + TENANT_KEY)
    tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4)
    ids = list(range(10, 71))
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([datum, datum], "cross_entropy").result(timeout=60)  # 120 tokens: at the budget
    with refill_when_limited(limited) as seen:
        small = types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7]})
        out = tc.forward_backward([small], "cross_entropy").result(timeout=60)
        sampler = tc.save_weights_and_get_sampling_client("t")
        params = types.SamplingParams(max_tokens=50, seed=1)
        samples = [sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=2,
                                  sampling_params=params).result(timeout=60) for _ in range(2)]
    assert len(out.loss_fn_outputs) == 1 and all(len(s.sequences) == 2 for s in samples)
    assert seen[0] >= 2 and answers(limited.service, "tinker", "429") == 0
    client.holder.close() if hasattr(client, "holder") else None


@pytest.mark.slow  # an official client's own retries, in real time (10-25 s each)
def test_the_openai_client_retries_a_429_until_the_budget_allows(limited, tiny_model_dir):
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=limited.url + "/api/openai/v1", api_key=TENANT_KEY, max_retries=3)
    model, prompt = str(tiny_model_dir), "hello there"
    prompt_tokens = len(AutoTokenizer.from_pretrained(model).encode(prompt))
    first = client.completions.create(model=model, prompt=prompt, max_tokens=BUDGET - prompt_tokens, seed=1)
    left = limited.service.budgets.left(tenant_id(TENANT_KEY))  # what the first did not use came back
    with refill_when_limited(limited) as seen:
        # one token more than is left (or, if nothing is, the smallest request)
        second = client.completions.create(model=model, prompt=prompt,
                                           max_tokens=max(1, int(left) - prompt_tokens + 1), seed=2)
    assert first.choices and second.choices
    assert seen[0] == 1 and answers(limited.service, "openai", "429") == 1


@pytest.mark.slow  # an official client's own retries, in real time (10-25 s each)
def test_the_pytrio_sdk_waits_for_the_budget_and_retries_samples(limited, tmp_path):
    import importlib.util

    helpers = Path(__file__).resolve().parents[1] / "pytrio" / "pytrio_support.py"  # (tests/pytrio is no package)
    spec = importlib.util.spec_from_file_location("pytrio_support", helpers)
    support = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(support)

    class Worker:
        base_url = limited.url

    model = next(iter(limited.service.models.sources))
    # after the held event the bucket holds 119: a sample costs 4 + 2 x 28 = 60, so the second is one token short
    plan = {"model": model, "first": [60, 60], "second": 1, "prompt": [5, 6, 7, 8], "max_tokens": 28}
    with refill_when_limited(limited) as seen:
        report = support.run_sdk(Worker, TENANT_KEY, "../../operator_view/scripts/pytrio_budget", plan,
                                 tmp_path / "sdk", timeout=240)
    assert report["at_budget"] and report["past_budget"]  # the training event held back, then run: not failed
    assert [len(s) for s in report["samples"]] == [2, 2] and all(len(t) == 28 for s in report["samples"] for t in s)
    assert seen[0] >= 2  # the held event, and the second sample's 429
    assert answers(limited.service, "pytrio", "429") >= 1
